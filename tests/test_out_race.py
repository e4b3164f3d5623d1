"""Two writers of one output at once, made deterministic: the first `vitmask sample --out` is paused
right after it has created its temp file (outputs.open_new wrapped), and the second runs whole
meanwhile, in this process or in a process of its own. The second, finished first, writes its file;
the first is refused in one line (exit 2) and its result is dropped: the output is the second's
bytes, whole, and no temp file is left.

Also each write of one file in flight in this process has a temp file of its own (outputs.temp_file_name),
however many are nested.

The model is the shipped `shapes` (read from the package, nothing trained); each writer draws with its
own seed, so the two results differ and the file left says whose it is."""

import contextlib
import io
import os
import subprocess
import sys

import pytest
from PIL import Image

from vitmask import outputs

pytestmark = pytest.mark.usefixtures("one_thread")
TAKEN = "was created or changed by someone else while this command ran"


def sample_args(out, seed: int) -> list[str]:
    return ["sample", "--checkpoint", "shapes", "--n", "1", "--steps", "2", "--seed", str(seed), "--out", str(out)]


def in_process(args: list[str]) -> tuple[int, str]:
    """`vitmask ARGS` in this process, its own streams captured (it may run inside another command)."""
    from vitmask.cli import commands

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            commands.main(args)
        except SystemExit as e:
            return (e.code if isinstance(e.code, int) else 0), err.getvalue()
    return 0, err.getvalue()


def in_a_process(args: list[str], cwd) -> tuple[int, str]:
    """`vitmask ARGS` in a process of its own (another pid, so other temp names)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, "-m", "vitmask", *args], cwd=cwd, env=env, capture_output=True, text=True)
    return res.returncode, res.stderr


def leftovers(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


@pytest.mark.parametrize("second_runs", ["in this process", "in another process"])
def test_two_samples_to_one_out_at_once_keep_the_first_to_finish_whole(tmp_path, monkeypatch, second_runs):
    refs = {seed: tmp_path / f"ref-{seed}.png" for seed in (1, 2)}
    for seed, ref in refs.items():  # what each writer writes alone
        assert in_process(sample_args(ref, seed))[0] == 0
    assert refs[1].read_bytes() != refs[2].read_bytes()
    folder = tmp_path / "outs"
    folder.mkdir()
    out = folder / "s.png"
    real_open_new, seen = outputs.open_new, {}

    def first_pauses_after_its_temp_file(path):
        f = real_open_new(path)
        if path.parent == folder and "first" not in seen:
            seen["first"] = path
            run = in_process if second_runs == "in this process" else lambda a: in_a_process(a, tmp_path)
            seen["second"] = run(sample_args(out, 2))  # the whole second writer, while the first holds its temp file
            seen["second's file"] = out.read_bytes() if out.exists() else None
            seen["first's temp kept"] = path.is_file() and os.path.samestat(os.fstat(f.fileno()), os.stat(path))
        elif path.parent == folder:
            seen["second's temp"] = path
        return f

    monkeypatch.setattr(outputs, "open_new", first_pauses_after_its_temp_file)
    code, err = in_process(sample_args(out, 1))
    code2, err2 = seen["second"]
    assert code2 == 0, err2
    assert seen["second's file"] == refs[2].read_bytes()  # written whole while the first was under way
    assert seen["first's temp kept"]  # the second wrote through a temp file of its own
    if second_runs == "in this process":
        assert seen["second's temp"] != seen["first"]
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and TAKEN in lines[0] and str(out) in lines[0] and "Traceback" not in err, err
    assert out.read_bytes() == refs[2].read_bytes()  # the second's, not replaced and not mixed
    with Image.open(out) as image:
        image.load()  # a whole PNG
    assert leftovers(folder) == []  # the loser's temp file is gone


def test_each_write_in_flight_of_one_file_has_its_own_temp_file(tmp_path):
    target = tmp_path / "x.png"
    with contextlib.ExitStack() as stack:
        names = [stack.enter_context(outputs.temp_file_name(target)) for _ in range(4)]
        assert len(set(names)) == 4
        for name in names:
            assert name.parent == tmp_path and name.name.startswith(".x.png.tmp-") and name.suffix == ".png"
    with outputs.temp_file_name(target) as again:
        assert again == names[0]  # free again once its write is over


def test_three_nested_writes_of_one_file_each_finish_with_their_own_bytes(tmp_path):
    """A write whose content is made while a second write of the same file runs, inside which a third
    runs: each goes through its own temp file, so each places its own whole bytes in turn."""
    target = tmp_path / "x.bin"
    placed = []
    real_place = outputs.place

    def recording(tmp, path, replaces, what=""):
        placed.append(tmp.read_bytes())
        return real_place(tmp, path, replaces, what)

    def write(level: int):
        def body(f):
            f.write(b"%d-start " % level)
            if level < 3:
                outputs.write_atomically(target, write(level + 1), replaces=outputs.REPLACE_ANY)
            f.write(b"%d-end" % level)

        return body

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(outputs, "place", recording)
        outputs.write_atomically(target, write(1), replaces=outputs.REPLACE_ANY)
    assert placed == [b"3-start 3-end", b"2-start 2-end", b"1-start 1-end"]
    assert target.read_bytes() == b"1-start 1-end" and leftovers(tmp_path) == []
