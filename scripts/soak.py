"""Soak test: random hostile cases against the `vitmask` CLI, each in its own process; counts.

Not part of the test suite: it takes minutes (about 3 s of start-up per case on an idle CPU).

    python scripts/soak.py --cases 300 --max-seconds 1800          # the full run
    python scripts/soak.py --cases 20 --seed 1                     # a smoke test

It trains one tiny checkpoint, writes a small folder dataset, a config and a file that belongs to
"someone else", then draws cases of these kinds:

- config: a hostile value for a config key (huge, negative, NaN, inf, a string, a 10^400, YAML
  nested thousands deep, a 2 MB file), through a YAML file or --set, to config, count-params,
  preview or train;
- out: an --out that is a dataset file, a link to one, a loop of links, the checkpoint itself, a
  folder, a missing folder, a link to someone else's file;
- checkpoint: a copy of the checkpoint with a byte flipped, truncated, or a block zeroed, given to
  eval, count-params, sample, probe or train --resume;
- numbers: extreme --n, --count, --seed, --steps, --nll-samples, --temperature, --mask-ratio;
- stdout: stdout closed (>&-) or a pipe whose reader is gone;
- signal: SIGINT or SIGTERM after a random delay, to train or eval;
- kill: SIGKILL during train; then `train --resume auto` must continue the run;
- disk: a full disk on train, sample or preview: half the cases write to a tmpfs of 16 KiB to 1 MiB
  mounted for the case (writes fail with ENOSPC; needs root, else every case takes the other way),
  half run under a file-size limit (RLIMIT_FSIZE: writes past it fail with EFBIG); then the run dir
  must resume or start again (the tmpfs grown first).

Every case is judged on: a traceback on stderr (a "traceback"); an exit other than 0, 2 with one
error line (warning lines may come before it), or 130/141/143 for a signal with at most one line
(an "unclean" end); and, after it, every protected file (the dataset, the checkpoint, the config,
someone else's file) byte for byte as it was, no temp file and no 0-byte file left in a run dir,
and a run dir that either resumes or accepts a fresh start (else a "data loss"). A case is
"clean" when it is none of these. The report gives the counts and, for each case that was not
clean, its command and the end of its stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import random
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
TINY = """seed: 0
data: {image_size: 16, patch_size: 2, batch_size: 16, num_train: 256, num_val: 32, num_test: 32}
mask: {ratio: 0.5}
model: {hidden_dim: 16, num_heads: 2, depth: 1, ffn_dim: 32}
train: {lr: 0.003, max_steps: 4, eval_every: 2, checkpoint_every: 2, log_every: 1}
"""
SIGNAL_CODES = {130, 141, 143}


@dataclass
class Outcome:
    kind: str
    args: list[str]
    code: int | None
    stderr: str
    problems: list[str] = field(default_factory=list)


class Soak:
    def __init__(self, work: Path, rng: random.Random, timeout: float):
        self.work, self.rng, self.timeout = work, rng, timeout
        self.base = work / "base"
        self.case_no = 0

    # ---- set-up ---------------------------------------------------------------------------------
    def prepare(self) -> None:
        import numpy as np
        from PIL import Image

        self.base.mkdir(parents=True)
        self.config = self.base / "tiny.yaml"
        self.config.write_text(TINY)
        self.data = self.base / "images"
        self.data.mkdir()
        pics = np.random.default_rng(0).random((40, 16, 16)) > 0.6
        for i, pic in enumerate(pics):
            Image.fromarray(pic.astype(np.uint8) * 255).save(self.data / f"{i:02d}.png")
        self.victim = self.base / "someone-elses.txt"
        self.victim.write_text("not vitmask's\n")
        self.image = self.base / "picture.png"
        Image.fromarray((pics[0] * 255).astype(np.uint8)).save(self.image)
        res = self.cli(["train", "--config", self.config, "--run-dir", self.base / "run", "--device", "cpu"])
        if res.returncode != 0:
            raise SystemExit(f"soak: the base training failed:\n{res.stderr}")
        self.checkpoint = self.base / "run" / "last.pt"
        self.protected = {p: digest(p) for p in self.base.rglob("*") if p.is_file() and not p.is_symlink()}

    def cli(self, args, **kw) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "vitmask", *map(str, args)],
            cwd=self.case_dir if hasattr(self, "case_dir") else self.work,
            env=ENV,
            capture_output=True,
            text=True,
            timeout=self.timeout,
            **kw,
        )

    # ---- one case -------------------------------------------------------------------------------
    def run_case(self) -> Outcome:
        self.case_no += 1
        self.case_dir = self.work / f"case-{self.case_no:04d}"
        self.case_dir.mkdir()
        self.mounts: list[Path] = []  # tmpfs mounted for this case
        kind = self.rng.choice(KINDS)
        try:
            outcome = getattr(self, f"case_{kind}")()
        except subprocess.TimeoutExpired as e:
            outcome = Outcome(kind, [str(a) for a in e.cmd[3:]], None, "", ["timed out"])
        self.judge(outcome)
        self.check_protected(outcome)
        while self.mounts:
            subprocess.run(["umount", "-l", str(self.mounts.pop())], capture_output=True)
        if not outcome.problems:
            shutil.rmtree(self.case_dir, ignore_errors=True)
        return outcome

    def judge(self, o: Outcome) -> None:
        lines = [ln for ln in o.stderr.splitlines() if ln.strip()]
        if "Traceback" in o.stderr:
            o.problems.append("traceback")
            return
        errors = [ln for ln in lines if not ln.startswith("vitmask: warning:")]
        if o.code == 0 or o.code is None:
            return
        if o.code == 2 and len(errors) == 1:
            return
        if o.code in SIGNAL_CODES and len(errors) <= 1:
            return
        if o.code == -signal.SIGKILL and o.kind == "kill":
            return
        o.problems.append(f"unclean end (exit {o.code}, {len(errors)} lines)")

    def check_protected(self, o: Outcome) -> None:
        for path, want in self.protected.items():
            if not path.is_file() or path.is_symlink() or digest(path) != want:
                o.problems.append(f"data loss: {path} changed")
                self.protected[path] = digest(path) if path.is_file() else ""
        for p in self.case_dir.rglob("*"):
            if p.is_file() and not p.is_symlink():
                if ".tmp-" in p.name:
                    o.problems.append(f"data loss: temp file left: {p}")
                elif p.stat().st_size == 0 and p.name.endswith((".pt", ".yaml", ".png")):
                    o.problems.append(f"data loss: 0-byte file left: {p}")

    def run_dir_is_usable(self, o: Outcome, run: Path) -> None:
        """A run dir after a failure: it resumes (it has a checkpoint) or a fresh start is accepted."""
        if not run.exists():
            return
        steps = [int(p.stem.split("_")[1]) for p in run.glob("step_*.pt")]
        args = ["train", "--run-dir", run, "--resume", "auto", "--config", self.config, "--device", "cpu"]
        res = self.cli([*args, "--set", f"train.max_steps={max(steps, default=0) + 1}"])
        if res.returncode != 0:
            o.problems.append(f"data loss: {run} neither resumes nor starts again: {tail(res.stderr)}")

    # ---- the kinds of case ----------------------------------------------------------------------
    def case_config(self) -> Outcome:
        key, value = self.rng.choice(HOSTILE_VALUES)
        verb = self.rng.choice(["config", "count-params", "preview", "train"])
        extra = {"preview": ["--out", self.case_dir / "p.png"], "train": ["--run-dir", self.case_dir / "run"]}
        if value == "DEEP":
            value = "[" * 3000 + "]" * 3000
        if value == "HUGE-FILE":
            big = self.case_dir / "big.yaml"
            big.write_text(TINY + "#" * (2 << 20))
            args = [verb, "--config", big, *extra.get(verb, [])]
        elif self.rng.random() < 0.5:
            args = [verb, "--config", self.config, "--set", f"{key}={value}", *extra.get(verb, [])]
        else:
            section, name = key.split(".") if "." in key else (None, key)
            cfg = self.case_dir / "c.yaml"
            body = f"{name}: {value}\n" if section is None else f"{section}:\n  {name}: {value}\n"
            cfg.write_text(body)
            args = [verb, "--config", cfg, *extra.get(verb, [])]
        res = self.cli(args)
        return Outcome("config", [str(a) for a in args], res.returncode, res.stderr)

    def case_out(self) -> Outcome:
        d = self.case_dir
        loop_a, loop_b = d / "loop-a.png", d / "loop-b.png"
        loop_a.symlink_to(loop_b)
        loop_b.symlink_to(loop_a)
        (d / "to-data.png").symlink_to(self.data / "03.png")
        (d / "to-victim.png").symlink_to(self.victim)
        (d / "folder.png").mkdir()
        verb = self.rng.choice(["preview", "reconstruct", "sample", "inpaint"])
        outs = [loop_a, self.checkpoint, d / "folder.png", d / "missing" / "x.png", d / "to-victim.png"]
        if verb == "preview":  # the one that reads the dataset here (the checkpoint's data is shapes)
            outs += [self.data / "05.png", d / "to-data.png"]
        if verb == "inpaint":
            outs += [self.image]
        out = self.rng.choice(outs)
        folder = ["--set", "data.source=folder", "--set", f"data.path={self.data}"]
        args = {
            "preview": ["preview", "--config", self.config, *folder, "--out", out],
            "reconstruct": ["reconstruct", "--checkpoint", self.checkpoint, "--out", out],
            "sample": ["sample", "--checkpoint", self.checkpoint, "--out", out, "--n", "2", "--steps", "2"],
            "inpaint": [
                "inpaint",
                "--checkpoint",
                self.checkpoint,
                "--image",
                self.rng.choice([self.image, loop_a]),
                "--box",
                "0,0,4,4",
                "--out",
                out,
            ],
        }[verb]
        res = self.cli(args)
        return Outcome("out", [str(a) for a in args], res.returncode, res.stderr)

    def case_checkpoint(self) -> Outcome:
        data = bytearray(self.checkpoint.read_bytes())
        how = self.rng.choice(["flip", "truncate", "zero"])
        at = self.rng.randrange(len(data))
        if how == "flip":
            data[at] ^= 1 << self.rng.randrange(8)
        elif how == "truncate":
            data = data[:at]
        else:
            data[at : at + 64] = bytes(min(64, len(data) - at))
        bad = self.case_dir / "bad.pt"
        bad.write_bytes(bytes(data))
        verb = self.rng.choice(["eval", "count-params", "sample", "probe", "train"])
        args = {
            "eval": ["eval", "--checkpoint", bad],
            "count-params": ["count-params", "--checkpoint", bad],
            "sample": ["sample", "--checkpoint", bad, "--out", self.case_dir / "s.png", "--n", "2", "--steps", "2"],
            "probe": ["probe", "--checkpoint", bad],
            "train": ["train", "--resume", bad, "--run-dir", self.case_dir / "run", "--set", "train.max_steps=6"],
        }[verb]
        res = self.cli(args)
        o = Outcome(f"checkpoint-{how}", [str(a) for a in args], res.returncode, res.stderr)
        if res.returncode == 0 and how in ("flip", "zero") and bytes(data) != self.checkpoint.read_bytes():
            o.problems.append("silent corruption: a changed checkpoint was accepted")
        return o

    def case_numbers(self) -> Outcome:
        big = self.rng.choice([0, -1, 2**31, 2**63 - 1, 2**63, 2**64, 10**30])
        ckpt = self.checkpoint
        args = self.rng.choice(
            [
                ["sample", "--checkpoint", ckpt, "--out", self.case_dir / "s.png", "--n", big],
                ["sample", "--checkpoint", ckpt, "--out", self.case_dir / "s.png", "--n", "2", "--steps", big],
                ["reconstruct", "--checkpoint", ckpt, "--out", self.case_dir / "r.png", "--n", big],
                ["preview", "--config", self.config, "--out", self.case_dir / "p.png", "--count", big],
                ["eval", "--checkpoint", ckpt, "--seed", big],
                ["eval", "--checkpoint", ckpt, "--nll", "--nll-samples", big],
                ["eval", "--checkpoint", ckpt, "--nll", "--nll-strata", big],
                ["sample", "--checkpoint", ckpt, "--out", self.case_dir / "s.png", "--temperature", "nan"],
                ["eval", "--checkpoint", ckpt, "--mask-ratio", self.rng.choice(["inf", "-0.5", "1", "nan"])],
                ["probe", "--checkpoint", ckpt, "--k", big],
            ]
        )
        res = self.cli(args)
        return Outcome("numbers", [str(a) for a in args], res.returncode, res.stderr)

    def case_stdout(self) -> Outcome:
        args = self.rng.choice(
            [
                ["eval", "--checkpoint", self.checkpoint],
                ["config", "--config", self.config],
                ["train", "--config", self.config, "--run-dir", self.case_dir / "run"],
                ["count-params", "--config", self.config],
            ]
        )
        if self.rng.random() < 0.5:  # closed: >&-
            res = self.cli_raw(args, preexec_fn=lambda: os.close(1))
        else:  # a pipe whose reader is gone
            read, write = os.pipe()
            os.close(read)
            try:
                res = self.cli_raw(args, stdout=write)
            finally:
                os.close(write)
        o = Outcome("stdout", [str(a) for a in args], res.returncode, res.stderr)
        if args[0] == "train":
            self.run_dir_is_usable(o, self.case_dir / "run")
        return o

    def cli_raw(self, args, stdout=subprocess.DEVNULL, preexec_fn=None) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "vitmask", *map(str, args)],
            cwd=self.case_dir,
            env=ENV,
            stdout=stdout,
            stderr=subprocess.PIPE,
            text=True,
            timeout=self.timeout,
            preexec_fn=preexec_fn,
        )

    def started(self, args) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-m", "vitmask", *map(str, args)],
            cwd=self.case_dir,
            env=ENV,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )

    def case_signal(self) -> Outcome:
        run = self.case_dir / "run"
        args = self.rng.choice(
            [
                ["train", "--config", self.config, "--run-dir", run, "--set", "train.max_steps=200"],
                ["eval", "--checkpoint", self.checkpoint, "--nll"],
            ]
        )
        sig = self.rng.choice([signal.SIGINT, signal.SIGTERM])
        proc = self.started(args)
        time.sleep(self.rng.uniform(0.0, 6.0))
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=self.timeout)
        o = Outcome(f"signal-{sig.name}", [str(a) for a in args], proc.returncode, err)
        if args[0] == "train":
            self.run_dir_is_usable(o, run)
        return o

    def case_kill(self) -> Outcome:
        run = self.case_dir / "run"
        args = ["train", "--config", self.config, "--run-dir", run, "--set", "train.max_steps=200"]
        proc = self.started(args)
        time.sleep(self.rng.uniform(1.0, 8.0))
        proc.kill()
        _, err = proc.communicate(timeout=self.timeout)
        o = Outcome("kill", [str(a) for a in args], proc.returncode, err)
        self.run_dir_is_usable(o, run)
        return o

    def mount_tmpfs(self, path: Path, size: int) -> bool:
        """A tmpfs of `size` bytes at `path` (False where it cannot be mounted: not root)."""
        path.mkdir(exist_ok=True)
        res = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
        return res.returncode == 0

    def case_disk(self) -> Outcome:
        if self.rng.random() < 0.5:
            size = self.rng.choice([16 << 10, 64 << 10, 256 << 10, 1 << 20])
            disk = self.case_dir / "disk"
            if self.mount_tmpfs(disk, size):
                self.mounts.append(disk)  # unmounted once the case is judged, leftovers included
                return self.case_full_tmpfs(disk, size)
        limit = self.rng.choice([0, 1000, 20_000, 60_000, 200_000])

        def small_disk():
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

        run = self.case_dir / "run"
        args = self.rng.choice(
            [
                ["train", "--config", self.config, "--run-dir", run],
                ["sample", "--checkpoint", self.checkpoint, "--out", self.case_dir / "s.png", "--n", "4"],
                ["preview", "--config", self.config, "--out", self.case_dir / "p.png"],
            ]
        )
        res = self.cli(args, preexec_fn=small_disk)
        o = Outcome(f"disk-{limit}", [str(a) for a in args], res.returncode, res.stderr)
        if args[0] == "train":
            self.run_dir_is_usable(o, run)
        return o

    def case_full_tmpfs(self, disk: Path, size: int) -> Outcome:
        """A command whose outputs go to a tmpfs of `size` bytes; the run dir is checked once it is grown."""
        run = disk / "run"
        args = self.rng.choice(
            [
                ["train", "--config", self.config, "--run-dir", run],
                ["sample", "--checkpoint", self.checkpoint, "--out", disk / "s.png", "--n", "4"],
                ["preview", "--config", self.config, "--out", disk / "p.png"],
            ]
        )
        res = self.cli(args)
        o = Outcome(f"tmpfs-{size >> 10}k", [str(a) for a in args], res.returncode, res.stderr)
        if args[0] == "train":
            subprocess.run(["mount", "-o", "remount,size=64m", str(disk)], capture_output=True)
            self.run_dir_is_usable(o, run)
        return o


KINDS = ["config", "out", "checkpoint", "numbers", "stdout", "signal", "kill", "disk"]
HOSTILE_VALUES = [
    ("seed", 2**64),
    ("seed", -(2**63) - 1),
    ("data.split_seed", 2**64),
    ("data.split_seed", 10**400),
    ("data.image_size", 2**70),
    ("data.batch_size", 0),
    ("data.num_train", 2**63),
    ("model.hidden_dim", -4),
    ("model.token_conv", 2**63 - 1),
    ("model.depth", 10**9),
    ("train.lr", "nan"),
    ("train.lr", "inf"),
    ("train.lr", "1e400"),
    ("train.max_steps", 2**64),
    ("train.keep_last", "three"),
    ("mask.ratio", 1.5),
    ("mask.ratio_range", "[0.9, 0.1]"),
    ("data.path", "'\\0'"),
    ("model.depth", "DEEP"),
    ("data.source", "npz"),
    ("name", "'../escape'"),
    ("seed", "HUGE-FILE"),
]


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def tail(text: str, lines: int = 3) -> str:
    return " | ".join(text.strip().splitlines()[-lines:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=300, help="cases to run at most")
    parser.add_argument("--max-seconds", type=float, default=1800, help="stop starting new cases after this")
    parser.add_argument("--seed", type=int, default=0, help="seed of the case draws")
    parser.add_argument("--timeout", type=float, default=180, help="seconds one command may take")
    parser.add_argument("--json", type=Path, default=None, help="also write the report here")
    parser.add_argument("--keep", action="store_true", help="keep the work folder (failing cases always stay)")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="vitmask-soak-"))
    soak = Soak(work, random.Random(args.seed), args.timeout)
    start = time.monotonic()
    soak.prepare()
    outcomes: list[Outcome] = []
    with contextlib.suppress(KeyboardInterrupt):
        while len(outcomes) < args.cases and time.monotonic() - start < args.max_seconds:
            outcomes.append(soak.run_case())
            o = outcomes[-1]
            mark = "ok" if not o.problems else "; ".join(o.problems)
            print(f"[{len(outcomes):4d}] {o.kind:<22} exit {o.code}  {mark}", flush=True)
    bad = [o for o in outcomes if o.problems]
    report = {
        "cases_run": len(outcomes),
        "clean": len(outcomes) - len(bad),
        "tracebacks": sum("traceback" in o.problems for o in outcomes),
        "unclean_ends": sum(any(p.startswith("unclean") for p in o.problems) for o in outcomes),
        "data_losses": sum(any(p.startswith(("data loss", "silent")) for p in o.problems) for o in outcomes),
        "timeouts": sum("timed out" in o.problems for o in outcomes),
        "by_kind": {k: sum(o.kind.startswith(k) for o in outcomes) for k in KINDS},
        "seconds": round(time.monotonic() - start),
        "failures": [
            {"kind": o.kind, "args": o.args, "exit": o.code, "problems": o.problems, "stderr": tail(o.stderr, 5)}
            for o in bad
        ],
        "work": str(work),
    }
    print(json.dumps({k: v for k, v in report.items() if k != "failures"}, indent=1))
    for f in report["failures"]:
        print(
            f"FAILED {f['kind']}: vitmask {' '.join(f['args'])}\n  exit {f['exit']}: {f['problems']}\n  {f['stderr']}"
        )
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    if not bad and not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
