"""scripts/speedrun.py runs end to end on a tiny config: its accuracy-versus-time curve, its saved
checkpoint and its bad input. No timing is asserted: `make speedrun` measures."""

from tests.conftest import ROOT, assert_user_error, run_script
from vitmask.store.checkpoint import load_checkpoint

SPEEDRUN = ROOT / "scripts" / "speedrun.py"


def test_speedrun_writes_an_accuracy_versus_time_curve(tiny_config, tmp_path):
    curve = tmp_path / "curve.csv"
    args = ["--config", tiny_config, "--device", "cpu", "--budget", "2", "--eval-every", "1", "--eval-batches", "1"]
    args += ["--target", "1.01", "--curve", curve, "--save", tmp_path / "last.pt"]
    res = run_script(SPEEDRUN, *args)
    assert res.returncode == 0, res.stderr
    assert "not reached in 2 s" in res.stdout  # a target above 1 is never reached
    lines = curve.read_text().splitlines()
    assert lines[0] == "seconds,step,loss,acc,acc_nonempty"
    rows = [list(map(float, ln.split(","))) for ln in lines[1:]]
    assert len(rows) >= 1
    seconds, steps = [r[0] for r in rows], [r[1] for r in rows]
    assert seconds == sorted(seconds) and steps == sorted(steps) and steps[0] >= 1
    assert seconds[-1] >= 2 and all(0 <= r[3] <= 1 and 0 <= r[4] <= 1 for r in rows)
    state = load_checkpoint(tmp_path / "last.pt")  # the trained model, for vitmask eval
    assert state["step"] == steps[-1]  # one optimisation step per recorded step


def test_speedrun_bad_ratio_is_a_user_error(tiny_config):
    res = run_script(SPEEDRUN, "--config", tiny_config, "--ratio", "1.5")
    assert_user_error(res, "--ratio", "between 0 and 1")
