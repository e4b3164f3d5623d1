"""The search space of a sweep: a YAML file mapping config keys to distributions (docs/sweeps.md#the-space).

    train.lr: {type: float, low: 1.0e-4, high: 1.0e-2, log: true}
    model.depth: {type: int, low: 2, high: 6}
    model.pos: {type: categorical, choices: [learned, rope2d]}

Each key is a config key in full (`section.key`, as `--set` takes it); each value names its `type`:

- `float`: `low`, `high` (low <= high), and either `log: true` (sampled on a log scale; low > 0) or
  a `step` (the values low, low + step, ...); neither: uniform;
- `int`: `low`, `high` (integers), and `log: true` (low >= 1) or a `step` (default 1);
- `categorical`: `choices`, a list of plain values (numbers, text, true, false, null), each once.

`load_space` reads and checks the file: an unknown key is refused as `--set` refuses it, with its
did-you-mean (config.py's own words); `check_values` builds the config at every bound and choice,
so a value the config refuses (a depth of 0, a positional scheme that does not exist) is one line
before anything runs. Values of several keys that only clash together (a width that the heads do
not divide) fail their trial alone (objective.py).
"""

import dataclasses
import difflib
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from vitmask.config import (
    MAX_CONFIG_BYTES,
    SECTIONS,
    ConfigSource,
    _unknown,
    load_config,
    safe_load_limited,
    valid_keys,
)
from vitmask.errors import UserError

KINDS = ("float", "int", "categorical")
FIELDS = {"float": ("low", "high", "log", "step"), "int": ("low", "high", "log", "step"), "categorical": ("choices",)}
EXAMPLE = "train.lr: {type: float, low: 1.0e-4, high: 1.0e-2, log: true}"


@dataclasses.dataclass(frozen=True)
class Param:
    """One key's distribution, its fields checked (`parse`)."""

    key: str
    kind: str
    low: float | int | None = None
    high: float | int | None = None
    log: bool = False
    step: float | int | None = None
    choices: tuple = ()

    def as_dict(self) -> dict[str, Any]:
        """The distribution as plain data, its own fields only: what a study keeps and compares."""
        if self.kind == "categorical":
            return {"type": "categorical", "choices": list(self.choices)}
        out = {"type": self.kind, "low": self.low, "high": self.high, "log": self.log}
        if self.step is not None:
            out["step"] = self.step
        return out

    def edges(self) -> list:
        """The values the config is built at before anything runs: the bounds, or every choice."""
        return list(self.choices) if self.kind == "categorical" else [self.low, self.high]

    def suggest(self, trial) -> Any:
        """This key's value for an Optuna trial (a retried trial gets the value of the trial it retries)."""
        if self.kind == "categorical":
            return trial.suggest_categorical(self.key, list(self.choices))
        if self.kind == "int":
            return trial.suggest_int(self.key, self.low, self.high, log=self.log, step=self.step or 1)
        return trial.suggest_float(self.key, self.low, self.high, log=self.log, step=self.step)


@dataclasses.dataclass(frozen=True)
class Space:
    params: tuple[Param, ...]
    path: Path | None = None

    @property
    def keys(self) -> list[str]:
        return [p.key for p in self.params]

    def as_dict(self) -> dict[str, dict]:
        return {p.key: p.as_dict() for p in self.params}

    def as_json(self) -> str:
        """The space as one JSON text, keys sorted: equal texts for equal spaces, whatever the file's order."""
        return json.dumps(self.as_dict(), sort_keys=True)

    def suggest(self, trial) -> dict[str, Any]:
        return {p.key: p.suggest(trial) for p in self.params}

    def difference(self, other: dict[str, dict]) -> str:
        """How the space `other` (as `as_dict` gives it) differs from this one, in words: the first key
        only one has, or the first key whose distribution differs."""
        mine = self.as_dict()
        for key in sorted(set(mine) | set(other)):
            if key not in mine:
                return f"it has {key}, which this space does not"
            if key not in other:
                return f"it has no {key}, which this space has"
            if mine[key] != other[key]:
                return f"its {key} is {_spec_text(other[key])}, here {_spec_text(mine[key])}"
        return "the same keys and distributions"


def _spec_text(spec: dict) -> str:
    return "{" + ", ".join(f"{k}: {json.dumps(v)}" for k, v in spec.items()) + "}"


def overrides(values: dict[str, Any]) -> list[str]:
    """`KEY=VALUE` overrides (as `--set` takes them) setting each key to its value: the value as JSON,
    which YAML reads back as the same value (a string stays a string, 1e-05 a number)."""
    return [f"{key}={json.dumps(value)}" for key, value in values.items()]


def load_space(path: Path) -> Space:
    """Read and check the space file `path` (the module docstring): one line for anything wrong in it."""
    path = Path(path)
    raw = _read(path)
    if raw is None or raw == {}:
        raise UserError(f"space {path} is empty; name at least one config key with its distribution, e.g. {EXAMPLE}")
    if not isinstance(raw, dict):
        raise UserError(f"space {path} must be a mapping of config keys to distributions, e.g. {EXAMPLE}")
    return Space(tuple(_parse(str(key), spec, path) for key, spec in raw.items()), path)


def _read(path: Path) -> Any:
    if path.exists() and not path.is_file():
        raise UserError(f"space {path} is not a file; pass a YAML file such as space.yaml")
    if not path.is_file():
        raise UserError(f"space file not found: {path}; pass an existing YAML file (docs/sweeps.md#the-space)")
    try:
        if path.stat().st_size > MAX_CONFIG_BYTES:
            raise UserError(f"space {path} is over {MAX_CONFIG_BYTES:,} bytes; a space is a few keys")
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read space {path}: {e.__class__.__name__}; check it is a readable text file") from None
    try:
        return safe_load_limited(text)
    except yaml.YAMLError as e:
        where = getattr(e, "problem_mark", None)
        at = f" at line {where.line + 1}, column {where.column + 1}" if where else ""
        raise UserError(
            f"bad YAML in space {path}{at}: {getattr(e, 'problem', None) or e}; fix the file's syntax"
        ) from None


def _parse(key: str, spec: Any, path: Path) -> Param:
    if key in SECTIONS:
        raise UserError(f"space {path}: {key} is a config section; name each key in full, e.g. {EXAMPLE}")
    if key not in valid_keys():
        raise _unknown(key, f"space {path}")
    where = f"space {path}: {key}"
    if not isinstance(spec, dict):
        raise UserError(
            f"{where} must be a distribution such as {{type: float, low: 1.0e-4, high: 1.0e-2}}, got {spec!r}"
        )
    kind = spec.get("type")
    if kind not in KINDS:
        near = difflib.get_close_matches(str(kind), KINDS, n=1, cutoff=0.5)
        hint = f"; did you mean '{near[0]}'?" if near else ""
        got = "no type" if kind is None else f"type {kind!r}"
        raise UserError(f"{where} has {got}; type must be one of {', '.join(KINDS)}{hint}")
    allowed = FIELDS[kind]
    for field in spec:
        if field != "type" and field not in allowed:
            near = difflib.get_close_matches(str(field), allowed, n=1, cutoff=0.5)
            hint = f"; did you mean '{near[0]}'?" if near else f"; a {kind} takes {', '.join(allowed)}"
            raise UserError(f"{where}: unknown field '{field}' for type {kind}{hint}")
    if kind == "categorical":
        return Param(key, kind, choices=_choices(spec, where))
    return _numeric(key, kind, spec, where)


def _choices(spec: dict, where: str) -> tuple:
    choices = spec.get("choices")
    if not isinstance(choices, list) or not choices:
        raise UserError(f"{where}: a categorical needs choices, a non-empty list such as [learned, rope2d]")
    seen = []
    for c in choices:
        if c is not None and not isinstance(c, (bool, int, float, str)):
            raise UserError(
                f"{where}: choice {c!r} is not a plain value; choices are numbers, text, true, false or null"
            )
        if isinstance(c, float) and not math.isfinite(c):
            raise UserError(f"{where}: choice {c!r} is not a finite number")
        if any(type(c) is type(s) and c == s for s in seen):
            raise UserError(f"{where}: choice {c!r} is listed twice; list each choice once")
        seen.append(c)
    return tuple(choices)


def _number(value: Any, kind: str, where: str, name: str) -> float | int:
    """`value` as the kind's number: an int for int, a finite float for float (YAML reads 1e-4 as text)."""
    if kind == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            raise UserError(f"{where}: {name} must be an integer for type int, got {value!r}")
        return value
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            pass
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise UserError(f"{where}: {name} must be a finite number, got {value!r}")
    return float(value)


def _numeric(key: str, kind: str, spec: dict, where: str) -> Param:
    for name in ("low", "high"):
        if name not in spec:
            raise UserError(f"{where}: a {kind} needs low and high, e.g. {{type: {kind}, low: 2, high: 6}}")
    low, high = _number(spec["low"], kind, where, "low"), _number(spec["high"], kind, where, "high")
    if low > high:
        raise UserError(f"{where}: low ({low}) is above high ({high})")
    log = spec.get("log", False)
    if not isinstance(log, bool):
        raise UserError(f"{where}: log must be true or false, got {log!r}")
    step = spec.get("step")
    if step is not None:
        step = _number(step, kind, where, "step")
        if step <= 0:
            raise UserError(f"{where}: step must be above 0, got {step}")
        if log:
            raise UserError(f"{where}: log and step cannot go together; give one")
    if log and kind == "float" and low <= 0:
        raise UserError(f"{where}: a log scale needs low above 0, got {low}")
    if log and kind == "int" and low < 1:
        raise UserError(f"{where}: a log scale needs low of at least 1, got {low}")
    return Param(key, kind, low, high, log, step)


def check_values(space: Space, config: ConfigSource, sets: Sequence[str]) -> None:
    """Build the config (`config` with the `--set`s `sets`) at every bound and choice of the space, one
    key at a time: a value the config refuses is one line naming the space, the key and the value."""
    clash = sorted(set(space.keys) & {item.partition("=")[0].strip() for item in sets})
    if clash:
        raise UserError(
            f"{clash[0]} is set by --set and searched by space {space.path}; drop one (the space's values "
            "would replace the --set's in every trial)"
        )
    for param in space.params:
        for value in param.edges():
            try:
                load_config(config, [*sets, *overrides({param.key: value})])
            except UserError as e:
                why = str(e).removeprefix("config: ")
                raise UserError(f"space {space.path}: {param.key} = {json.dumps(value)} is refused: {why}") from None
