"""`vitmask export`, `vitmask.load_pretrained` and export dirs as every verb's --checkpoint.

The checkpoint is a tiny model trained 30 steps with an EMA of its weights; what an export holds
is checked against the checkpoint's own entries (`ema`, `model`), read with torch.load.
"""

import json
import subprocess
import sys

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

from tests.conftest import ROOT, assert_user_error, train_tiny
from vitmask.config import config_from_dict
from vitmask.data.batches import load_splits
from vitmask.data.patches import patchify
from vitmask.model.vit import build_model
from vitmask.store.checkpoint import load_checkpoint, save_checkpoint
from vitmask.store.onnx_export import missing_onnx_packages

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def run_cli(run_cli_in_process):
    return run_cli_in_process


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """30 steps of the tiny model with train.ema_decay 0.9 (so the EMA differs from the weights)."""
    return train_tiny(tmp_path_factory.mktemp("ckpt"), {"train": {"ema_decay": 0.9}})


@pytest.fixture(scope="module")
def plain_ckpt(ckpt, tmp_path_factory):
    """The same checkpoint without its EMA entry, as a run with train.ema_decay 0 writes it."""
    state = load_checkpoint(ckpt)
    del state["ema"]
    state.pop("format")
    state["config"]["train"]["ema_decay"] = 0.0
    return save_checkpoint(state, tmp_path_factory.mktemp("plain") / "last.pt")


def test_load_pretrained_is_lazy_and_import_vitmask_loads_no_torch():
    code = "import sys, vitmask; assert 'torch' not in sys.modules; f = vitmask.load_pretrained; print(f.__module__)"
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env={"PYTHONPATH": str(ROOT / "src")}
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "vitmask.store.export"


def test_an_export_holds_the_ema_weights_the_config_and_a_card_and_loads_without_pickle(
    run_cli, ckpt, tmp_path, monkeypatch
):
    import vitmask

    out = tmp_path / "export"
    res = run_cli("export", "--checkpoint", ckpt, "--out", out)
    assert res.returncode == 0, res.stderr
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    state = torch.load(ckpt, weights_only=True)
    saved = load_file(out / "model.safetensors")
    assert saved.keys() == state["ema"].keys()
    for k, v in state["ema"].items():
        assert torch.equal(saved[k], v), k
    assert any(not torch.equal(state["ema"][k], state["model"][k]) for k in saved), "EMA equal to the weights"

    meta = json.loads((out / "config.json").read_text())
    assert meta["format"] == "vitmask-export/1" and meta["vitmask_version"] == vitmask.__version__
    assert meta["weights"] == "ema" and meta["encoder_only"] is False
    assert meta["data"]["image_size"] == 16 and meta["data"]["patch_size"] == 2 and meta["data"]["fit"] == "pad"
    assert meta["data"]["threshold"] == 0.5 and meta["data"]["invert"] is False and "bit" in meta["data"]["bit_order"]
    assert meta["num_patches"] == 64 and meta["patch_dim"] == 4 and meta["num_classes"] == 16
    assert meta["model"]["hidden_dim"] == 32 and meta["model"]["depth"] == 2
    card = (out / "README.md").read_text()
    assert "vitmask train --config" in card and "step 30" in card
    assert f"{state['val']['ema']['loss']:.4f}" in card  # the run's last EMA validation loss

    def no_pickle(*args, **kwargs):
        raise AssertionError("torch.load (pickle) was called")

    monkeypatch.setattr(torch, "load", no_pickle)
    model = vitmask.load_pretrained(out)
    assert not model.training
    want = build_model(config_from_dict(state["config"]))
    want.load_state_dict(state["ema"])
    images = load_splits(config_from_dict(state["config"]))["test"][:8]
    patches = patchify(images, 2).float()
    mask = torch.rand(8, 64, generator=torch.Generator().manual_seed(0)) < 0.5
    with torch.no_grad():
        assert torch.equal(model(patches, mask), want.eval()(patches, mask))


def test_weights_raw_exports_the_trained_weights_and_ema_needs_an_ema(run_cli, ckpt, plain_ckpt, tmp_path):
    out = tmp_path / "raw"
    assert run_cli("export", "--checkpoint", ckpt, "--out", out, "--weights", "raw").returncode == 0
    state = torch.load(ckpt, weights_only=True)
    saved = load_file(out / "model.safetensors")
    assert all(torch.equal(saved[k], v) for k, v in state["model"].items())
    assert json.loads((out / "config.json").read_text())["weights"] == "raw"

    missing = tmp_path / "never"
    res = run_cli("export", "--checkpoint", plain_ckpt, "--out", missing, "--weights", "ema")
    assert_user_error(res, "--weights ema", "no EMA weights", "--weights raw")
    assert not missing.exists()
    res = run_cli("eval", "--checkpoint", plain_ckpt, "--weights", "ema", "--device", "cpu")
    assert_user_error(res, "no EMA weights")
    # the export of a checkpoint without EMA holds its raw weights, and asking it for EMA is refused
    plain = tmp_path / "plain"
    assert run_cli("export", "--checkpoint", plain_ckpt, "--out", plain).returncode == 0
    assert_user_error(run_cli("probe", "--checkpoint", plain, "--weights", "ema"), "holds the raw weights only")


def test_every_verb_takes_an_export_dir_and_eval_scores_it_as_the_checkpoint(run_cli, ckpt, tmp_path):
    out = tmp_path / "export"
    assert run_cli("export", "--checkpoint", ckpt, "--out", out).returncode == 0
    args = ["--split", "test", "--device", "cpu", "--json", "--mask-ratio", "0.5"]
    from_dir = run_cli("eval", "--checkpoint", out, *args)
    from_ckpt = run_cli("eval", "--checkpoint", ckpt, *args)  # EMA by default, as the export
    raw = run_cli("eval", "--checkpoint", ckpt, *args, "--weights", "raw")
    assert from_dir.returncode == from_ckpt.returncode == raw.returncode == 0, from_dir.stderr
    a, b = json.loads(from_dir.stdout)["results"], json.loads(from_ckpt.stdout)["results"]
    assert a[0]["loss"] == b[0]["loss"] and a[0]["acc"] == b[0]["acc"]
    assert json.loads(raw.stdout)["results"][0]["loss"] != a[0]["loss"]

    image = tmp_path / "in.png"
    Image.new("L", (16, 16), 0).save(image)
    for verb in (
        ["sample", "--out", tmp_path / "s.png", "--n", "2", "--steps", "2"],
        ["inpaint", "--image", image, "--box", "0,0,4,4", "--out", tmp_path / "f.png"],
        ["reconstruct", "--out", tmp_path / "r.png", "--n", "2"],
        ["probe", "--k", "5"],
    ):
        res = run_cli(verb[0], "--checkpoint", out, *verb[1:], "--device", "cpu")
        assert res.returncode == 0, (verb[0], res.stderr)
    full = run_cli("count-params", "--checkpoint", out)
    assert full.returncode == 0 and full.stdout == run_cli("count-params", "--checkpoint", ckpt).stdout


def test_encoder_only_drops_the_head_and_the_decoder(run_cli, tmp_path):
    (tmp_path / "dec").mkdir()
    ckpt = train_tiny(
        tmp_path / "dec",
        {"model": {"decoder": "cross"}, "mask": {"fill": "learned"}, "train": {"max_steps": 2, "eval_every": 2}},
    )
    out = tmp_path / "encoder"
    assert run_cli("export", "--checkpoint", ckpt, "--out", out, "--encoder-only").returncode == 0
    saved = load_file(out / "model.safetensors")
    state = torch.load(ckpt, weights_only=True)["model"]
    kept = {k for k in state if not k.startswith(("decoder.", "head."))}
    assert saved.keys() == kept and any(k.startswith("decoder.") for k in state)
    assert json.loads((out / "config.json").read_text())["encoder_only"] is True
    full = tmp_path / "full"
    assert run_cli("export", "--checkpoint", ckpt, "--out", full).returncode == 0
    assert load_file(full / "model.safetensors").keys() == state.keys()  # everything, to train on

    assert_user_error(run_cli("eval", "--checkpoint", out, "--device", "cpu"), "encoder only", "--encoder-only")
    counted = run_cli("count-params", "--checkpoint", out).stdout.splitlines()[-1]
    assert counted.split()[-1] == f"{sum(v.numel() for k, v in state.items() if k in kept):,}"


def test_bad_export_input_is_one_line_and_writes_nothing(run_cli, ckpt, tmp_path, monkeypatch):
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "notes.txt").write_text("mine")
    assert_user_error(run_cli("export", "--checkpoint", ckpt, "--out", taken), "already exists and holds files")
    assert [p.name for p in taken.iterdir()] == ["notes.txt"] and (taken / "notes.txt").read_text() == "mine"

    out = tmp_path / "export"
    assert run_cli("export", "--checkpoint", ckpt, "--out", out).returncode == 0
    weights = (out / "model.safetensors").read_bytes()
    (out / "model.safetensors").unlink()
    assert_user_error(run_cli("eval", "--checkpoint", out), "model.safetensors is missing", "vitmask export")

    # a weights file of another export: its checksum is not the one config.json was written with
    tensors = {k: v + 1 for k, v in load_file_bytes(weights).items()}
    save_file(tensors, out / "model.safetensors")
    assert_user_error(run_cli("sample", "--checkpoint", out, "--out", tmp_path / "s.png"), "SHA-256 differs")

    (out / "model.safetensors").write_bytes(weights)
    meta = json.loads((out / "config.json").read_text())
    meta["training"]["config"]["model"]["hidden_dim"] = 64  # a config of another model beside these weights
    (out / "config.json").write_text(json.dumps(meta))
    assert_user_error(run_cli("probe", "--checkpoint", out), "does not fit config.json")
    (out / "config.json").unlink()
    assert_user_error(run_cli("eval", "--checkpoint", out), "config.json is missing")

    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "onnxscript" else real(n, *a))
    never = tmp_path / "never"
    res = run_cli("export", "--checkpoint", ckpt, "--out", never, "--onnx")
    assert_user_error(res, "pip install -e '.[onnx]'", "onnxscript")
    assert not never.exists()


def load_file_bytes(data: bytes) -> dict[str, torch.Tensor]:
    from safetensors.torch import load

    return load(data)


@pytest.mark.skipif(bool(missing_onnx_packages()), reason=f"the onnx extra is missing: {missing_onnx_packages()}")
def test_the_onnx_graph_gives_torchs_logits_and_draws_nothing_random(run_cli, tmp_path):
    import onnx
    import onnxruntime

    overrides = {
        "model": {"dropout": 0.1, "token_conv": 3, "pos": "rope2d+learned"},
        "mask": {"fill": "learned"},
        "train": {"max_steps": 4, "eval_every": 4, "checkpoint_every": 4},
    }
    (tmp_path / "run").mkdir()
    ckpt = train_tiny(tmp_path / "run", overrides)
    out = tmp_path / "export"
    res = run_cli("export", "--checkpoint", ckpt, "--out", out, "--onnx")
    assert res.returncode == 0, res.stderr
    graph = onnx.load(out / "model.onnx").graph
    ops = {n.op_type for n in graph.node}
    assert not ops & {
        "Dropout",
        "RandomUniform",
        "RandomUniformLike",
        "RandomNormal",
        "RandomNormalLike",
        "Multinomial",
    }
    assert [i.name for i in graph.input] == ["patches", "mask"]

    state = torch.load(ckpt, weights_only=True)
    model = build_model(config_from_dict(state["config"]))
    model.load_state_dict(state["model"])
    model.eval()
    images = load_splits(config_from_dict(state["config"]))["test"][:5]  # a batch size other than the trace's
    patches = patchify(images, 2).float()
    mask = torch.rand(5, 64, generator=torch.Generator().manual_seed(1)) < 0.6
    runtime = onnxruntime.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
    (logits,) = runtime.run(None, {"patches": patches.numpy(), "mask": mask.numpy()})
    with torch.no_grad():
        want = model(patches, mask)
    assert torch.allclose(torch.from_numpy(logits), want, atol=1e-4, rtol=0)


def test_export_and_pack_make_the_missing_folders_of_out_and_remove_them_when_they_fail(
    run_cli, ckpt, tmp_path, monkeypatch
):
    """`--out a/b/c` of export and pack makes a/ and a/b/ as mkdir -p would; a write that fails
    removes the folders it made and leaves what was there; a file in the way is one line."""
    import errno

    from tests.conftest import write_config
    from vitmask.store import export as exports

    out = tmp_path / "exports" / "mnist" / "v1"
    assert run_cli("export", "--checkpoint", ckpt, "--out", out).returncode == 0
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
    packed = tmp_path / "data" / "packs" / "tiny"
    config = write_config(tmp_path / "tiny.yaml")
    assert run_cli("pack", "--config", config, "--out", packed).returncode == 0
    assert (packed / "header.json").is_file()

    def full_disk(tensors, file):
        raise OSError(errno.ENOSPC, "No space left on device", str(file))

    monkeypatch.setattr(exports, "save_weights", full_disk)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    res = run_cli("export", "--checkpoint", ckpt, "--out", tmp_path / "exports" / "new" / "deeper" / "v2")
    assert_user_error(res, "free some space and run it again")
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before  # exports/new is gone again
    (tmp_path / "afile").write_text("x")
    assert_user_error(run_cli("export", "--checkpoint", ckpt, "--out", tmp_path / "afile" / "v3"), "is a file")
    assert_user_error(run_cli("pack", "--config", config, "--out", tmp_path / "afile" / "p"), "is a file")
