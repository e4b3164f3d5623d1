"""scripts/time_curve.py's own parts, without a training: a row read off an eval report (the numbers its
table and plot use), the CSV read back as numbers, the plot drawn, and refusals before any run."""

import csv
import importlib.util

import pytest
from PIL import Image

from tests.conftest import ROOT

spec = importlib.util.spec_from_file_location("time_curve", ROOT / "scripts" / "time_curve.py")
time_curve = importlib.util.module_from_spec(spec)
spec.loader.exec_module(time_curve)

REPORT = {  # the fields of `vitmask eval --mask-ratio 0.5 --centre-box --nll --json` a row reads
    "results": [
        {"strategy": "random", "acc_nonempty": 0.59021},
        {"strategy": "centre", "acc_nonempty": 0.32789},
    ],
    "nll": {"nats": 60.1049, "exact": {"bound_same_images": 61.234, "fixed": {"nats": 58.876}}},
}


def test_a_row_takes_the_bound_the_exact_raster_nll_and_both_accuracies_from_the_eval_report():
    row = time_curve.row_of(300.0, 287.44, 4500, REPORT)
    assert row == {"budget_s": 300.0, "wall_s": 287.4, "steps": 4500, "nll_bound": 60.1, "nll_bound_first100": 61.23,
                   "nll_exact_raster_first100": 58.88, "acc_nonempty_r05": 0.5902,
                   "acc_nonempty_centre_box": 0.3279}  # fmt: skip
    assert list(row) == list(time_curve.FIELDS)


def test_the_csv_reads_back_as_numbers_and_two_curves_plot(tmp_path):
    rows = [time_curve.row_of(b, b - 10, int(b * 15), REPORT) for b in (150.0, 300.0)]
    file = tmp_path / "curve.csv"
    with open(file, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=time_curve.FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    assert time_curve.read_curve(file) == [{k: float(v) for k, v in r.items()} for r in rows]
    other = [{**r, "nll_bound": r["nll_bound"] + 3, "nll_exact_raster_first100": r["nll_bound"] + 2} for r in rows]
    time_curve.plot({"a": time_curve.read_curve(file), "b": other}, tmp_path / "curve.png")
    img = Image.open(tmp_path / "curve.png").convert("RGB")
    assert img.size == (720, 440)
    colours = set(img.get_flattened_data())
    assert (31, 119, 180) in colours and (214, 39, 40) in colours  # both curves are drawn


@pytest.mark.parametrize(
    "extra,needle",
    [(["--beside", "nocsv"], "--beside takes NAME=CSV"), (["--beside", "x=/no/such.csv"], "--beside takes NAME=CSV")],
)
def test_bad_arguments_are_refused_before_any_run(tmp_path, extra, needle):
    with pytest.raises(SystemExit, match=needle):
        time_curve.main(["--data", str(tmp_path), "--out", str(tmp_path / "new"), *extra])
    assert not (tmp_path / "new").exists()
    (tmp_path / "taken").mkdir()
    with pytest.raises(SystemExit, match="exists; pass a new folder"):
        time_curve.main(["--data", str(tmp_path), "--out", str(tmp_path / "taken")])
