"""Check vitmask's import graph: no cycles between modules, and packages that depend in one direction.

Reads every module under src/vitmask with `ast` (nothing is imported or run) and collects the
vitmask modules each one imports, at any depth of the file (imports inside functions count: they
are cycles too, only deferred). The rules, each failure printed on its own line:

- no cycle between modules (a module that imports itself through others);
- nothing imports the command line (vitmask.cli) but vitmask.__main__ and cli's own modules
  (CLI_IMPORTERS): what the verbs share with another package lives below both;
- a module imports only from its own package or from packages of a lower layer in LAYERS, and
  never across a pair of INDEPENDENT packages (whatever their layers).

Exit code 1 on any failure, 0 otherwise. `make lint` runs it; `python scripts/check_imports.py
ROOT` checks the tree under ROOT/vitmask instead of src/vitmask.
"""

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "src"

# Lowest first. A package may import from its own layer's package and from any lower layer.
# The top package (`vitmask/__init__.py`) is the public face: it imports `load_pretrained` lazily
# (a module __getattr__), so it sits above everything, and modules that read its __version__ import
# no module by that (the package itself is left out of the graph). demo has a layer of its own
# between inference and cli: the web page's server uses the library only, and the command line's
# `vitmask demo` starts it, an import downward; it never reaches up into cli (CLI_IMPORTERS).
LAYERS = [
    {"config", "errors", "outputs", "progress", "signals", "sizes", "pretrained"},  # leaves: stdlib and errors only
    {"runtime"},
    {"data", "model"},  # independent of each other (INDEPENDENT)
    {"evaluate"},
    {"generate"},
    {"store"},
    {"train"},
    {"sweep"},  # the hyper-parameter search: each trial a run of train/run.py
    {"inference"},
    {"demo"},  # the page and its server: opens its model with inference.open, as the verbs do
    {"cli", "__main__"},  # the command line, `vitmask demo` included (it starts demo.serve); see CLI_IMPORTERS
    {"__init__"},
]

# The packages that may import vitmask.cli: the command line is the top of the tree, started by
# `python -m vitmask` (__main__.py) and the `vitmask` script (cli.entry), and imported by nothing else,
# whatever its layer (the public face, vitmask/__init__.py, above it in LAYERS, included).
CLI_IMPORTERS = {"cli", "__main__"}

# (importer, imported): packages one never imports from the other, whatever their layers. Drawing
# masks and images is data's, applying a mask to tokens is the model's; what both need lives in a
# leaf (sizes.py). A checkpoint on disk is no evaluation's: the pooling's names live with the pooling.
INDEPENDENT = {
    ("model", "data"): "what model/ and data/ both need lives in a leaf (vitmask/sizes.py)",
    ("data", "model"): "what model/ and data/ both need lives in a leaf (vitmask/sizes.py)",
    ("store", "evaluate"): "the store depends on no evaluation; move what it needs below it (e.g. model/pooling.py)",
}


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path, name: str, modules: set[str]) -> set[str]:
    """The vitmask modules that `path` imports (a package's import counts as its __init__)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*up, base] if base else up)
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        found |= {t for t in targets if t in modules and t != name}
    return found


def layer_of(module: str) -> int:
    top = module.split(".")[1] if "." in module else "__init__"
    top = top.removesuffix(".py")
    for i, names in enumerate(LAYERS):
        if top in names:
            return i
    raise SystemExit(f"check_imports: {module} sits in no layer of LAYERS: add its package there")


def package_of(module: str) -> str:
    return module.split(".")[1] if module.count(".") >= 1 else module


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected group of more than one module (Tarjan), each as a sorted list."""
    index, low, stack, on_stack, groups, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return groups


def check(root: Path) -> tuple[list[str], int, int]:
    """The failures of the tree under root/vitmask, one line each, and its module and import counts."""
    paths = sorted((root / "vitmask").rglob("*.py"))
    names = {module_name(p, root): p for p in paths}
    modules = set(names)
    graph = {n: imports_of(p, n, modules) - {"vitmask"} for n, p in names.items()}
    failures = [f"import cycle: {' <-> '.join(group)}" for group in find_cycles(graph)]
    for n, deps in sorted(graph.items()):
        for d in sorted(deps):
            if package_of(d) == "cli" and package_of(n) not in CLI_IMPORTERS:
                failures.append(
                    f"cli: {n} imports {d}; nothing imports vitmask.cli but vitmask.__main__, so move what "
                    "both need below them (e.g. into inference/)"
                )
                continue  # the one line for this import: the layering's would repeat it
            same_package = package_of(n) == package_of(d)
            if not same_package and layer_of(d) > layer_of(n):
                failures.append(f"layering: {n} imports {d}, a package above its own layer")
            why = INDEPENDENT.get((package_of(n), package_of(d)))
            if why is not None:
                failures.append(f"independence: {n} imports {d}; {why}")
            if layer_of(n) == 0 and layer_of(d) == 0 and d.split(".")[-1] not in ("errors",):
                failures.append(
                    f"layering: the leaf {n} imports {d}; leaves import only the standard library and errors"
                )
    return failures, len(names), sum(map(len, graph.values()))


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    root = Path(args[0]) if args else ROOT
    failures, modules, imports = check(root)
    for line in failures:
        print(line)
    print(f"check_imports: {modules} modules, {imports} imports, {len(failures)} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
