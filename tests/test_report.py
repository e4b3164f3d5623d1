"""The reporter: given numbers become exactly these TensorBoard scalars, console lines and hparams."""

import torch

from tests.conftest import RecordingLogger
from vitmask.config import config_from_dict
from vitmask.train import report
from vitmask.train.report import Reporter

CFG = config_from_dict({"seed": 3, "train": {"max_steps": 100, "lr": 1e-3}, "mask": {"ratio": 0.4}})
WINDOW = {"loss": 1.234567, "acc": 0.5, "acc_nonempty": 0.25, "bit_acc": 0.75, "masked_patches": 8}
VAL = {"loss": 0.98766, "acc": 0.875, "acc_nonempty": 0.375, "bit_acc": 0.9375, "majority_acc": 0.8125}


class ImageLogger(RecordingLogger):
    def __init__(self):
        super().__init__()
        self.images, self.hparams = [], []

    def log_image(self, tag, image, step):
        self.images.append((tag, tuple(image.shape), step))

    def log_hparams(self, hparams, metrics, step=0):
        self.hparams.append((hparams, metrics, step))


def clock(monkeypatch, *times: float) -> None:
    """time.perf_counter returns `times` one after the other."""
    ticks = iter(times)
    monkeypatch.setattr(report.time, "perf_counter", lambda: next(ticks))


def test_a_training_window_becomes_scalars_and_one_line(monkeypatch, capsys):
    logger = RecordingLogger()
    r = Reporter(CFG, logger, torch.device("cpu"))
    clock(monkeypatch, 10.0, 12.0, 16.0)
    r.start(40, progress=False)
    r.train(50, WINDOW, grad_norm=0.5, lr=1e-3, images=64)  # 64 images in 2 s
    r.train(60, WINDOW, grad_norm=0.5, lr=1e-3, images=64)  # 64 images in the 4 s since
    want = {
        "train/loss": 1.234567,
        "train/acc": 0.5,
        "train/acc_nonempty": 0.25,
        "train/bit_acc": 0.75,
        "train/lr": 1e-3,
        "train/grad_norm": 0.5,
    }
    assert logger.rows == [(50, {**want, "train/images_per_s": 32.0}), (60, {**want, "train/images_per_s": 16.0})]
    assert capsys.readouterr().out.splitlines() == [
        # batch 128: half a step in 2 s, 50 steps left -> 200 s; then half a step in 4 s, 40 left -> 320 s
        "step 50/100  loss 1.23457  acc 0.5000  lr 1.000e-03  grad norm 0.500  32 img/s  ETA 03:20",
        "step 60/100  loss 1.23457  acc 0.5000  lr 1.000e-03  grad norm 0.500  16 img/s  ETA 05:20",
    ]


def test_an_evaluation_becomes_val_scalars_the_grid_and_one_line(capsys):
    logger = ImageLogger()
    r = Reporter(CFG, logger, torch.device("cpu"))
    r.start(0, progress=False)
    r.validation(70, VAL, grid=lambda: torch.zeros(3, 10, 20))
    want = {"val/loss": 0.98766, "val/acc": 0.875, "val/acc_nonempty": 0.375, "val/bit_acc": 0.9375}
    assert logger.rows == [(70, want)]
    assert logger.images == [("val/reconstruction", (3, 10, 20), 70)]
    assert capsys.readouterr().out == (
        "step 70/100  val loss 0.9877  acc 0.8750  non-empty acc 0.3750  (majority 0.8125)\n"
    )


def test_an_online_probe_becomes_probe_scalars_and_one_line(capsys):
    logger = RecordingLogger()
    r = Reporter(CFG, logger, torch.device("cpu"))
    r.start(0, progress=False)
    r.probe(40, {"probe/knn_acc": 0.71875, "probe/linear_acc": 0.65625})
    assert logger.rows == [(40, {"probe/knn_acc": 0.71875, "probe/linear_acc": 0.65625})]
    assert capsys.readouterr().out == "step 40/100  probe on val: k-NN acc 0.7188  linear acc 0.6562\n"


def test_hparams_are_every_config_key_beside_the_final_metrics():
    logger = ImageLogger()
    Reporter(CFG, logger).hparams(VAL, best_val_loss=0.5, step=100)
    ((hparams, metrics, step),) = logger.hparams
    assert step == 100
    assert metrics == {
        "hparam/val_loss": 0.98766,
        "hparam/val_acc": 0.875,
        "hparam/val_acc_nonempty": 0.375,
        "hparam/val_bit_acc": 0.9375,
        "hparam/best_val_loss": 0.5,
    }
    assert hparams["seed"] == 3 and hparams["train.lr"] == 1e-3 and hparams["mask.ratio"] == 0.4
    assert hparams["mask.ratio_range"] == "None"  # TensorBoard takes no None: it becomes text
    sections = {"train", "model", "mask", "data", "finetune"}
    n_keys = sum(len(v) if k in sections else 1 for k, v in CFG.to_dict().items())
    assert len(hparams) == n_keys  # every key, none lost in the flattening
    assert "init" not in hparams  # a run from its random init names no initial weights


def test_a_run_from_given_weights_names_their_path_beside_the_config_keys():
    logger = ImageLogger()
    init = {"path": "export/mnist", "kind": "export dir", "weights": "ema", "step": 12200, "run_id": "ab"}
    Reporter(CFG, logger).hparams(VAL, best_val_loss=0.5, step=100, init=init)
    ((hparams, _, _),) = logger.hparams
    assert hparams["init"] == "export/mnist" and hparams["seed"] == 3


def test_ranks_other_than_0_report_nothing(capsys):
    logger = ImageLogger()
    r = Reporter(CFG, logger, torch.device("cpu"), main=False)
    r.start(0)
    r.train(10, WINDOW, grad_norm=1.0, lr=1e-3, images=8)
    r.validation(10, VAL, grid=lambda: 1 / 0)  # never drawn
    r.probe(10, {"probe/knn_acc": 0.5, "probe/linear_acc": 0.5})
    r.hparams(VAL, 0.5, 10)
    assert logger.rows == [] and logger.images == [] and logger.hparams == []
    assert capsys.readouterr().out == ""
