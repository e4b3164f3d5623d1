import dataclasses

import pytest

from tests.conftest import ROOT
from vitmask.config import Config, config_from_dict, dump_config, load_config
from vitmask.errors import UserError


def test_defaults_and_files_load_into_frozen_typed_config():
    cfg = load_config(ROOT / "configs" / "default.yaml")
    assert isinstance(cfg, Config) and cfg.name == "default"
    assert cfg.model.norm_position == "pre" and cfg.model.depth >= 2
    with pytest.raises(AttributeError):
        cfg.seed = 3  # frozen


def test_unknown_key_is_rejected_with_the_nearest_valid_key():
    with pytest.raises(UserError, match=r"unknown key 'model\.hiden_dim'; did you mean 'model\.hidden_dim'"):
        config_from_dict({"model": {"hiden_dim": 64}})
    with pytest.raises(UserError, match="did you mean 'train.lr'"):
        config_from_dict({}, ["train.lrr=0.1"])
    with pytest.raises(UserError, match="unknown key 'modle'"):
        config_from_dict({"modle": {}})


@pytest.mark.parametrize(
    "raw,needle",
    [
        ({"model": {"hidden_dim": "big"}}, "model.hidden_dim has the wrong type"),
        ({"model": {"depth": 2.5}}, "model.depth has the wrong type"),
        ({"model": {"qkv_bias": 1}}, "model.qkv_bias has the wrong type"),
        ({"train": {"lr": True}}, "train.lr has the wrong type"),
        ({"data": {"image_size": 30, "patch_size": 4}}, "must be divisible by data.patch_size"),
        ({"model": {"hidden_dim": 100, "num_heads": 3}}, "must be divisible by model.num_heads"),
        ({"mask": {"ratio": 1.0}}, "mask.ratio must be in (0, 1)"),
        ({"mask": {"ratio": 0}}, "mask.ratio must be in (0, 1)"),
        ({"model": {"activation": "tanh"}}, "model.activation must be one of"),
        ({"train": {"max_steps": 0}}, "train.max_steps must be >= 1"),
        ({"data": 3}, "section 'data' must be a mapping"),
    ],
)
def test_wrong_types_and_impossible_combinations_are_rejected(raw, needle):
    with pytest.raises(UserError) as e:
        config_from_dict(raw)
    assert needle in str(e.value)


def test_overrides_are_applied_last_and_typed():
    cfg = config_from_dict({"train": {"lr": 0.1}}, ["train.lr=3e-4", "model.depth=2", "seed=7", "model.qkv_bias=false"])
    assert cfg.train.lr == 3e-4 and cfg.model.depth == 2 and cfg.seed == 7 and cfg.model.qkv_bias is False
    assert config_from_dict({}, ["train.lr=1"]).train.lr == 1.0  # an int is a valid float
    with pytest.raises(UserError, match="KEY=VALUE"):
        config_from_dict({}, ["train.lr"])


def test_dumped_config_loads_back_equal(tmp_path):
    cfg = config_from_dict({"model": {"depth": 3}}, ["train.lr=0.002"])
    p = tmp_path / "c.yaml"
    p.write_text(dump_config(cfg))
    assert load_config(p) == cfg


def test_every_config_field_is_documented_where_it_is_declared():
    # README: "see src/vitmask/config.py, where every field is documented": a docstring under each field
    # (the string statement right after it in the class body), which docs/configuration.md is made from
    import ast
    import dataclasses

    from vitmask.config import SECTIONS

    tree = ast.parse((ROOT / "src" / "vitmask" / "config.py").read_text())
    bodies = {node.name: node.body for node in tree.body if isinstance(node, ast.ClassDef)}
    for cls in (Config, *SECTIONS.values()):
        body = bodies[cls.__name__]
        for f in dataclasses.fields(cls):
            if f.name in SECTIONS and cls is Config:
                continue  # a section: its own fields are checked
            at = next(i for i, n in enumerate(body) if isinstance(n, ast.AnnAssign) and n.target.id == f.name)
            doc = body[at + 1] if at + 1 < len(body) else None
            assert isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant), f"{cls.__name__}.{f.name}"
            assert isinstance(doc.value.value, str) and len(doc.value.value) > 10, f"{cls.__name__}.{f.name}"


def test_field_defaults_the_readme_names():
    cfg = Config()
    assert cfg.model.pos == "learned" and cfg.model.attention == "auto" and cfg.model.num_kv_heads == 0
    assert cfg.mask.fill == 0.5 and cfg.mask.strategy == "random"
    assert cfg.data.source == "shapes" and cfg.data.npz_key == "images" and cfg.data.bad_files == "skip"
    assert (cfg.data.image_size, cfg.data.patch_size, cfg.data.num_classes) == (32, 2, 16)  # 32x32, 2x2 patches


def test_shipped_configs_are_what_the_readme_table_says():
    default = load_config(ROOT / "configs" / "default.yaml")
    d, m, t = default.data, default.model, default.train
    assert (d.source, d.image_size, d.patch_size) == ("shapes", 32, 2)
    assert (m.norm_position, m.norm, m.depth, m.hidden_dim, m.pos) == ("pre", "layernorm", 4, 64, "rope2d")
    assert default.mask.fill == "learned"
    assert (t.optimizer, t.schedule) == ("adamw", "cosine") and t.warmup_steps > 0
    mnist = load_config(ROOT / "configs" / "mnist.yaml")
    d = mnist.data
    assert (d.source, d.name, d.path, d.download) == ("torchvision", "MNIST", "data/mnist", True)
    assert (d.image_size, d.fit, d.threshold) == (28, "none", 0.5)  # 28x28 as they are, binarized at 0.5
    assert mnist.model.pos == "rope2d+learned" and mnist.mask.fill == "learned" and mnist.model.token_conv == 3
    assert (mnist.train.optimizer, mnist.train.precision, mnist.train.compile) == ("muon", "auto", True)
    seed = load_config(ROOT / "configs" / "seed.yaml")
    d, m = seed.data, seed.model
    assert (d.image_size, d.num_patches, m.hidden_dim, m.num_heads, m.ffn_dim) == (64, 1024, 128, 2, 512)
    assert (m.norm, m.qkv_bias, m.out_proj) == ("none", False, False)


@pytest.mark.parametrize(
    "override, needle",
    [
        ("train.compile_mode=fastest", "train.compile_mode must be one of default, reduce-overhead, max-autotune"),
        ("train.step_shapes=dynamic", "train.step_shapes must be one of auto, static, masked"),
        ("data.source=parquet", "data.source must be one of shapes, torchvision, idx, folder, npz, npy, packed"),
        (
            "data.on_device=sometimes",
            "data.on_device has the wrong type: got 'sometimes', expected auto, true or false",
        ),
        ("train.compile=3", "train.compile has the wrong type: got 3, expected true or false"),
        ("finetune.pool=max", "finetune.pool must be one of mean, grid"),
    ],
)
def test_a_value_outside_a_fields_choices_is_refused_naming_the_key_and_the_choices(override, needle):
    with pytest.raises(UserError) as e:
        config_from_dict({}, [override])
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_on_device_takes_auto_or_a_yaml_boolean():
    assert config_from_dict({}, ["data.on_device=true"]).data.on_device is True
    assert config_from_dict({}, ["data.on_device=false"]).data.on_device is False
    assert config_from_dict({}).data.on_device == "auto"


# ---- several config files: composed in order, key by key, then --set ----------------------------------------
BASE = "name: base\nseed: 3\nmodel: {depth: 2, hidden_dim: 64}\ntrain: {lr: 0.01, max_steps: 100, loggers: [csv]}\n"
MINE = "model: {depth: 6}\ntrain: {max_steps: 200}\n"


def two_files(tmp_path):
    (tmp_path / "base.yaml").write_text(BASE)
    (tmp_path / "mine.yaml").write_text(MINE)
    return tmp_path / "base.yaml", tmp_path / "mine.yaml"


def test_later_files_win_key_by_key_then_the_overrides(tmp_path):
    base, mine = two_files(tmp_path)
    cfg = load_config([base, mine], ["train.lr=0.002"])
    # by hand: base's keys, mine's over them key by key (model.hidden_dim stays base's), --set last
    want = {
        "name": "base",  # mine sets no name: the last file that does names the run
        "seed": 3,
        "model": {"depth": 6, "hidden_dim": 64},
        "train": {"lr": 0.002, "max_steps": 200, "loggers": ["csv"]},
    }
    assert cfg == config_from_dict(want)
    assert load_config([mine, base]).model.depth == 2 and load_config([mine, base]).train.max_steps == 100
    (tmp_path / "plain.yaml").write_text("train: {lr: 0.5}\n")
    assert load_config([tmp_path / "plain.yaml", mine]).name == "mine"  # no name anywhere: the last file's stem
    assert load_config([base]) == load_config(base)  # one file in a list: that file


def test_an_unknown_key_in_any_file_is_refused_naming_that_file(tmp_path):
    base, mine = two_files(tmp_path)
    (tmp_path / "typo.yaml").write_text("train: {lrr: 0.1}\n")
    for files in ([tmp_path / "typo.yaml", base], [base, mine, tmp_path / "typo.yaml"]):
        with pytest.raises(UserError) as e:
            load_config(files)
        assert str(e.value) == f"config: unknown key 'train.lrr' in {tmp_path / 'typo.yaml'}; did you mean 'train.lr'?"
    (tmp_path / "top.yaml").write_text("colour: red\n")
    with pytest.raises(UserError, match=f"unknown key 'colour' in {tmp_path / 'top.yaml'}"):
        load_config([base, tmp_path / "top.yaml"])
    (tmp_path / "old.yaml").write_text("train: {eval_batches: 2}\n")  # a key `_upgrade` reads into train.eval_images
    assert load_config([base, tmp_path / "old.yaml"]).train.eval_images == 512


def test_vitmask_config_prints_the_composed_config(tmp_path, run_cli_in_process):
    base, mine = two_files(tmp_path)
    res = run_cli_in_process("config", "--config", base, "--config", mine, "--set", "train.lr=0.002")
    assert res.returncode == 0, res.stderr
    assert res.stdout == dump_config(load_config([base, mine], ["train.lr=0.002"]))
    import yaml

    shown = yaml.safe_load(res.stdout)
    assert (shown["model"]["depth"], shown["model"]["hidden_dim"], shown["train"]["lr"]) == (6, 64, 0.002)
    (tmp_path / "typo.yaml").write_text("model: {dept: 3}\n")
    res = run_cli_in_process("config", "--config", base, "--config", tmp_path / "typo.yaml")
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert res.stderr.splitlines() == [
        f"vitmask: error: config: unknown key 'model.dept' in {tmp_path / 'typo.yaml'}; did you mean 'model.depth'?"
    ]
    res = run_cli_in_process("config", "--config", base, "--config", tmp_path / "missing.yaml")
    assert res.returncode == 2 and f"config file not found: {tmp_path / 'missing.yaml'}" in res.stderr


def test_train_composes_its_config_files_and_names_the_run_after_them(tmp_path, run_cli_in_process, monkeypatch):
    from tests.conftest import write_config
    from vitmask.store.checkpoint import load_checkpoint

    monkeypatch.chdir(tmp_path)
    write_config(tmp_path / "tiny.yaml", {"train": {"max_steps": 2, "eval_every": 2, "checkpoint_every": 2}})
    (tmp_path / "short.yaml").write_text("name: short\nmodel: {depth: 1}\n")
    res = run_cli_in_process("train", "--config", "tiny.yaml", "--config", "short.yaml", "--device", "cpu")
    assert res.returncode == 0, res.stderr
    saved = load_checkpoint(tmp_path / "runs" / "short" / "last.pt")["config"]
    assert saved["model"]["depth"] == 1 and saved["model"]["hidden_dim"] == 32 and saved["train"]["max_steps"] == 2


def test_list_keys_take_a_list_or_one_value_and_refuse_anything_else():
    assert config_from_dict({}, ["train.loggers=[csv, jsonl]"]).train.loggers == ("csv", "jsonl")
    assert config_from_dict({}, ["train.loggers=jsonl"]).train.loggers == ("jsonl",)
    assert config_from_dict({}, ["train.loggers=[]"]).train.loggers == ()
    with pytest.raises(UserError, match="train.loggers must be a list such as"):
        config_from_dict({"train": {"loggers": {"csv": 1}}})
    with pytest.raises(UserError, match="got 'tensorbord'; did you mean 'tensorboard'"):
        config_from_dict({"train": {"loggers": ["tensorbord"]}})
    with pytest.raises(UserError, match="train.loggers must be one of .*got 'x'"):  # built in Python too
        Config(train=dataclasses.replace(Config().train, loggers=("x",)))
