"""A path never becomes a model's name: `./mnist`, `mnist/`, `Path("mnist")` where nothing is there are
refused in one line, in every command's model option and every Python loader, and never load the
shipped model of that name. Only a bare name in text (`mnist`) names a shipped model; an existing
path, however written, is that path.

The refusals come before anything is read, so these run against the models shipped in the package."""

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import vitmask
from tests.conftest import assert_user_error, write_config
from vitmask import pretrained
from vitmask.errors import UserError

pytestmark = pytest.mark.usefixtures("one_thread")

# each written as a path, its last part a shipped model's name
MASKED_FORMS = ["./mnist", "mnist/", "./shapes", "sub/shapes", ".\\mnist"]
CLASSIFIER_FORMS = ["./mnist-classifier", "mnist-classifier/"]

# the verb's arguments, MODEL where the model goes, and the option that takes it
MASKED_VERBS = [
    (["sample", "--checkpoint", "MODEL", "--out", "x.png", "--n", "1", "--steps", "1"], "--checkpoint"),
    (["inpaint", "--checkpoint", "MODEL", "--image", "IMG", "--box", "0,0,8,8", "--out", "x.png"], "--checkpoint"),
    (["reconstruct", "--checkpoint", "MODEL", "--out", "x.png", "--n", "1"], "--checkpoint"),
    (["eval", "--checkpoint", "MODEL", "--split", "test"], "--checkpoint"),
    (["probe", "--checkpoint", "MODEL"], "--checkpoint"),
    (["count-params", "--checkpoint", "MODEL"], "--checkpoint"),
    (["export", "--checkpoint", "MODEL", "--out", "e"], "--checkpoint"),
    (["finetune", "--checkpoint", "MODEL", "--config", "CONFIG", "--run-dir", "ft"], "--checkpoint"),
    (["train", "--config", "CONFIG", "--init", "MODEL", "--run-dir", "run"], "--init"),
    (["demo", "--checkpoint", "MODEL", "--port", "0"], "--checkpoint"),
]
CLASSIFIER_VERBS = [
    (["predict", "--checkpoint", "MODEL", "--input", "IMG", "--out", "p.csv"], "--checkpoint"),
    (["eval", "--checkpoint", "MODEL", "--confusion", "c.png"], "--checkpoint"),
    (["demo", "--classifier", "MODEL", "--port", "0"], "--classifier"),
]
CASES = [(args, flag, form) for args, flag in MASKED_VERBS for form in MASKED_FORMS] + [
    (args, flag, form) for args, flag in CLASSIFIER_VERBS for form in CLASSIFIER_FORMS
]


@pytest.fixture
def no_serving(monkeypatch):
    """A demo that starts serving fails the test instead (it should have been refused)."""
    pytest.importorskip("starlette", reason="the demo extra (starlette) is not installed")
    import vitmask.demo.serve

    def refuse(self, sockets=None):
        raise AssertionError("the demo started serving")

    monkeypatch.setattr(vitmask.demo.serve.DemoServer, "run", refuse)


def shipped_name(form: str) -> str:
    return form.replace("\\", "/").strip("./").split("/")[-1]


@pytest.mark.parametrize("args, flag, form", CASES, ids=[f"{c[0][0]}{c[1]}={c[2]}" for c in CASES])
def test_a_path_that_is_not_there_is_refused_by_every_model_option(
    run_cli_in_process, request, tmp_path, monkeypatch, args, flag, form
):
    if args[0] == "demo":
        request.getfixturevalue("no_serving")
    monkeypatch.chdir(tmp_path)
    Image.fromarray((np.arange(256).reshape(16, 16) % 7 * 40).astype(np.uint8)).save("in.png")
    write_config(tmp_path / "c.yaml")
    given = {"MODEL": form, "IMG": "in.png", "CONFIG": "c.yaml"}
    res = run_cli_in_process(*(given.get(a, a) for a in args))
    name = shipped_name(form)
    assert_user_error(res, f"{flag} {form}:", "nothing at that path", f"without a path: {flag} {name}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.yaml", "in.png"]  # nothing written


@pytest.mark.parametrize("load", [vitmask.load_pretrained, vitmask.load_masked_model], ids=lambda f: f.__name__)
@pytest.mark.parametrize("path", ["./mnist", "mnist/", "./shapes", Path("mnist"), Path("./shapes"), Path("mnist/")])
def test_a_masked_loader_refuses_a_path_that_is_not_there(tmp_path, monkeypatch, load, path):
    monkeypatch.chdir(tmp_path)
    name = Path(path).name
    with pytest.raises(UserError) as e:
        load(path)
    text = str(e.value)
    assert "\n" not in text and f"{load.__name__}: there is nothing at the path" in text
    assert repr(str(path)) in text and f'{load.__name__}("{name}")' in text


@pytest.mark.parametrize("path", ["./mnist-classifier", "mnist-classifier/", Path("mnist-classifier")])
def test_load_classifier_refuses_a_path_that_is_not_there(tmp_path, monkeypatch, path):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match=r'nothing at the path .*load_classifier\("mnist-classifier"\)'):
        vitmask.load_classifier(path)


@pytest.mark.parametrize("path", ["./mnist", Path("mnist")])
def test_image_processor_from_pretrained_refuses_a_path_that_is_not_there(tmp_path, monkeypatch, path):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match="without a path"):
        vitmask.ImageProcessor.from_pretrained(path)


def same_weights(model: torch.nn.Module, folder: Path) -> bool:
    from safetensors.torch import load_file

    want = load_file(folder / "model.safetensors")
    state = model.state_dict()
    return state.keys() == want.keys() and all(torch.equal(state[k], want[k]) for k in want)


def test_an_existing_path_wins_however_it_is_written(run_cli_in_process, tmp_path, monkeypatch):
    """A folder ./mnist holding the shipped shapes model: every way of writing its path reads it."""
    monkeypatch.chdir(tmp_path)
    shapes = pretrained.SHIPPED["shapes"].folder
    shutil.copytree(shapes, tmp_path / "mnist")
    for path in ("./mnist", "mnist/", Path("mnist"), "mnist"):
        assert same_weights(vitmask.load_pretrained(path), shapes), path
        assert same_weights(vitmask.load_masked_model(path).model, shapes), path
    assert not same_weights(vitmask.load_pretrained(Path(shapes.parent / "mnist")), shapes)  # the real mnist
    counted = {form: run_cli_in_process("count-params", "--checkpoint", form) for form in ("./mnist", "mnist/")}
    want = run_cli_in_process("count-params", "--checkpoint", "shapes")
    assert want.returncode == 0 and all(r.returncode == 0 and r.stdout == want.stdout for r in counted.values())


def test_a_file_named_like_a_model_is_no_folder(run_cli_in_process, tmp_path, monkeypatch):
    """A file `mnist` here: `mnist/` names a folder, which is not there (refused); `./mnist` is the file."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mnist").write_text("not a model")
    assert_user_error(run_cli_in_process("count-params", "--checkpoint", "mnist/"), "mnist/", "without a path")
    res = run_cli_in_process("count-params", "--checkpoint", "./mnist")
    assert res.returncode == 2 and "without a path" not in res.stderr  # the file's own fault, named by its loader


@pytest.mark.parametrize(
    "path, is_path",
    [
        ("mnist", False),
        ("mnist-classifier", False),
        ("last.pt", False),
        ("./mnist", True),
        ("mnist/", True),
        (".\\mnist", True),
        ("a\\b", True),
        (".hidden", True),
        (".", True),
        ("runs/x/last.pt", True),
        (Path("mnist"), True),
    ],
)
def test_written_as_path(path, is_path):
    assert pretrained.written_as_path(path) is is_path


def test_check_model_arg_leaves_other_missing_paths_to_their_loader(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for path in ("runs/last.pt", "./mnst", Path("other"), "mnist", "shapes"):
        pretrained.check_model_arg(path, "--checkpoint")  # nothing raised
    with pytest.raises(UserError, match=r"--init sub/mnist: .* --init mnist"):
        pretrained.check_model_arg("sub/mnist", "--init")
