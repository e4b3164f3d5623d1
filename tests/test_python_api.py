"""The Python API at its door (docs/python.md): `vitmask.load_classifier`, `load_masked_model`,
`load_pretrained` and `ImageProcessor` read the documented image layouts and dtypes as written out by
hand, refuse every other argument in one line (a UserError) before any work, and fit images of
another size only by an explicit choice (`fit=`, `vitmask predict --fit`), recorded in the output.

Expectations are independent of the code under test: binary pixels from colours whose luma is far
from the threshold, patches cut with reshape/permute, a classifier built from the checkpoint's own
EMA entry, and fits done by slicing (pad, center_crop) or by torch's own interpolate (resize).
"""

import csv
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

import vitmask
from tests.conftest import TINY, assert_user_error, train_tiny
from vitmask.config import config_from_dict
from vitmask.data.batches import load_labelled_splits
from vitmask.data.processor import ImageProcessor, ProcessedImages
from vitmask.errors import UserError
from vitmask.model.classifier import Classifier
from vitmask.model.vit import build_model
from vitmask.store.checkpoint import load_checkpoint
from vitmask.train.finetune import FinetuneTrainer

pytestmark = pytest.mark.usefixtures("one_thread")
CPU = torch.device("cpu")

# colours (R, G, B) and whether their luma (0.299 R + 0.587 G + 0.114 B) is at least 128: none is near 127.5
COLOURS = [
    ((255, 0, 0), 0),
    ((0, 255, 0), 1),
    ((0, 0, 255), 0),
    ((255, 255, 255), 1),
    ((200, 200, 0), 1),
    ((0, 0, 0), 0),
]


@pytest.fixture
def run_cli(run_cli_in_process):
    return run_cli_in_process


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    train = {"ema_decay": 0.9, "max_steps": 10, "eval_every": 10, "checkpoint_every": 10}
    return train_tiny(tmp_path_factory.mktemp("pre"), {"train": train})


def finetune(pretrained, root, data: dict | None = None):
    """6 steps of fine-tuning the tiny model on the shapes' labels (TINY's data plus `data`); its last.pt."""
    train = {**TINY["train"], "max_steps": 6, "eval_every": 6, "checkpoint_every": 6, "ema_decay": 0.5}
    cfg = config_from_dict({**TINY, "data": {**TINY["data"], **(data or {})}, "train": train})
    FinetuneTrainer(cfg, load_labelled_splits(cfg), CPU, load_checkpoint(pretrained)["ema"]).fit(root, progress=False)
    return root / "last.pt"


@pytest.fixture(scope="module")
def finetuned(pretrained, tmp_path_factory):
    return finetune(pretrained, tmp_path_factory.mktemp("ft"))


@pytest.fixture(scope="module")
def fit_none(pretrained, tmp_path_factory):
    """A classifier trained with data.fit none: images of another size are refused unless a fit is chosen."""
    return finetune(pretrained, tmp_path_factory.mktemp("ftnone"), {"fit": "none"})


@pytest.fixture(scope="module")
def exported(pretrained, tmp_path_factory):
    from vitmask.store.export import export

    out = tmp_path_factory.mktemp("exp") / "model"
    export(pretrained, out)
    return out


def reference(ckpt) -> Classifier:
    """The classifier of a fine-tuning checkpoint, built by hand from its own EMA entry."""
    state = torch.load(ckpt, weights_only=True)
    model = Classifier(build_model(config_from_dict(state["config"])), len(state["ema"]["head.bias"]), 4, 0.01)
    model.load_state_dict(state["ema"])
    return model.eval()


def hand_patches(pixels) -> torch.Tensor:
    """(B, 16, 16) 0/1 pixels -> (B, 64, 4) float 2x2 patches, row by row."""
    pix = torch.as_tensor(np.asarray(pixels), dtype=torch.float32)
    return pix.reshape(len(pix), 8, 2, 8, 2).permute(0, 1, 3, 2, 4).reshape(len(pix), 64, 4)


def hand_probabilities(ckpt, pixels) -> torch.Tensor:
    with torch.no_grad():
        return reference(ckpt)(hand_patches(pixels)).softmax(-1)


def colour_images(n: int, h: int = 16, w: int = 16, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(n, h, w, 3) uint8 RGB images of COLOURS and their (n, h, w) binary pixels, by the table."""
    pick = np.random.default_rng(seed).integers(0, len(COLOURS), (n, h, w))
    rgb = np.array([c for c, _ in COLOURS], dtype=np.uint8)[pick]
    return rgb, np.array([b for _, b in COLOURS], dtype=np.uint8)[pick]


def gray_images(n: int, h: int = 16, w: int = 16, seed: int = 0) -> np.ndarray:
    """(n, h, w) uint8 gray levels 0..99 or 156..255 (none near the threshold)."""
    rng = np.random.default_rng(seed)
    on = rng.random((n, h, w)) < 0.4
    return np.where(on, rng.integers(156, 256, (n, h, w)), rng.integers(0, 100, (n, h, w))).astype(np.uint8)


def case_id(value) -> str:
    """A test id: the value as text, cut short (an integer past Python's digit limit as 'huge')."""
    try:
        return str(getattr(value, "shape", value))[:30]
    except ValueError:
        return "huge"


def read_only(array: np.ndarray) -> np.ndarray:
    out = array.copy()
    out.setflags(write=False)
    return out


def binary(gray) -> np.ndarray:
    return (np.asarray(gray) >= 128).astype(np.uint8)


# ---- A: image layouts --------------------------------------------------------------------------------
def test_one_rgb_image_as_an_array_is_one_image_read_by_its_luma(finetuned):
    classifier = vitmask.load_classifier(finetuned)
    rgb, pixels = colour_images(1)
    want = hand_probabilities(finetuned, pixels)  # (1, 4)
    pil = Image.fromarray(rgb[0])
    for form in (rgb[0], np.asarray(pil), torch.from_numpy(rgb[0]), pil, np.dstack([rgb[0], np.full((16, 16), 255)])):
        top = classifier.predict(form, top_k=4)
        assert len(top) == 1, type(form)
        assert torch.allclose(top.probabilities, want.sort(descending=True).values, atol=1e-6, rtol=0)
    assert torch.equal(classifier.processor(rgb[0]).pixels, torch.from_numpy(pixels))


def test_every_documented_layout_is_read_as_written(finetuned):
    classifier = vitmask.load_classifier(finetuned)
    proc = classifier.processor
    rgb, pixels = colour_images(3, seed=1)
    gray = gray_images(3, seed=2)
    want_gray = torch.from_numpy(binary(gray))
    cases = [
        (gray[0], want_gray[:1]),  # (H, W)
        (gray[0][:, :, None], want_gray[:1]),  # (H, W, 1)
        (rgb[0], torch.from_numpy(pixels[:1])),  # (H, W, 3)
        (gray, want_gray),  # (B, H, W)
        (gray[:, :, :, None], want_gray),  # (B, H, W, 1)
        (rgb, torch.from_numpy(pixels)),  # (B, H, W, 3)
        (np.concatenate([rgb, np.full((3, 16, 16, 1), 255, np.uint8)], axis=3), torch.from_numpy(pixels)),  # RGBA
        (
            [gray[0], rgb[1], Image.fromarray(gray[2])],
            torch.stack([want_gray[0], torch.from_numpy(pixels[1]), want_gray[2]]),
        ),
        ((gray[0], gray[1]), want_gray[:2]),  # a tuple is a list
    ]
    for images, want in cases:
        assert torch.equal(proc(images).pixels, want), getattr(images, "shape", type(images))
        assert torch.equal(proc(torch.as_tensor(images)).pixels, want) if isinstance(images, np.ndarray) else True
    # the same batch as (B, H, W, 3) predicts what each image predicts alone
    assert torch.allclose(classifier.probabilities(rgb), hand_probabilities(finetuned, pixels), atol=1e-6, rtol=0)


@pytest.mark.parametrize(
    ("images", "needle"),
    [
        (
            np.zeros((2, 3, 16, 16), np.uint8),
            r"shape \(2, 3, 16, 16\); channels first is not read.*permute\(0, 2, 3, 1\)",
        ),
        (np.zeros((2, 16, 16, 2), np.uint8), r"shape \(2, 16, 16, 2\); a batch is \(B, H, W\) or \(B, H, W, C\)"),
        (np.zeros((1, 1, 16, 16, 1), np.uint8), r"shape \(1, 1, 16, 16, 1\); pass one image"),
        (np.zeros(16, np.uint8), r"shape \(16,\)"),
        (np.array(3), r"shape \(\)"),
        (np.zeros((0, 16, 16), np.uint8), "no pixels"),
        (np.zeros((16, 0), np.uint8), "no pixels"),
        (np.zeros((0, 16, 16, 3), np.uint8), "no pixels"),
        ([], "no images given"),
        ([np.zeros((2, 16, 16), np.uint8)], r"image 0: shape \(2, 16, 16\); an entry of a list is one image"),
        ([np.zeros((16, 16), np.uint8), [[0, 1]]], "image 1 is of type list"),
        (Image.new("L", (0, 0)), "0x0 PIL image, no pixels"),
        (Image.new("RGB", (5, 0)), "5x0 PIL image, no pixels"),
        (Image.new("RGBA", (16, 16), (0, 0, 0, 0)), "transparent pixels"),
        (np.zeros((16, 16, 2), np.uint8), r"shape \(16, 16, 2\), which is one gray-and-alpha image or a batch"),
        (np.ma.masked_array(np.zeros((16, 16)), mask=np.eye(16)), "masked array with masked pixels"),
        ("", "the image is an empty path"),
        ("a\x00b.png", "holds a NUL character"),
        ("x" * 5000 + ".png", "cannot be looked at"),
        ("no/such/file.png", "image not found"),
        ((x for x in [np.zeros((16, 16))]), "is of type generator"),
        (None, "is of type NoneType"),
        (b"\x89PNG", "is of type bytes"),
        (3.5, "is of type float"),
        ({"pixels": 1}, "is of type dict"),
    ],
    ids=case_id,
)
def test_a_layout_that_is_not_documented_is_refused_in_one_line(finetuned, images, needle):
    classifier = vitmask.load_classifier(finetuned)
    with pytest.raises(UserError, match=needle) as e:
        classifier.predict(images)
    assert "\n" not in str(e.value)


# ---- A: dtypes ---------------------------------------------------------------------------------------
def test_dtypes_numpy_cannot_hold_are_read_by_their_values(finetuned):
    classifier = vitmask.load_classifier(finetuned)
    gray = gray_images(2, seed=3)
    want = hand_probabilities(finetuned, binary(gray))
    levels = torch.from_numpy(gray / 255.0)  # float64 in [0, 1]
    forms = {
        "bfloat16": levels.to(torch.bfloat16),
        "float16": levels.to(torch.float16),
        "float8": levels.to(torch.float8_e4m3fn),
        "requires_grad": levels.float().requires_grad_(),
        "uint16": torch.from_numpy(gray.astype(np.uint16)),
        "int8 0/1": torch.from_numpy(binary(gray).astype(np.int8)),
        "bool": torch.from_numpy(binary(gray).astype(bool)),
        "big-endian >f4": (gray / 255.0).astype(">f4"),
        "big-endian >u2": gray.astype(">u2"),
        "strided": np.repeat(np.repeat(gray, 2, axis=1), 2, axis=2)[:, ::2, ::2],
        "fortran": np.asfortranarray(gray.astype(np.uint8)),
        "read-only": read_only(gray),
        "transposed tensor": torch.from_numpy(gray.astype(np.uint8)).transpose(1, 2).contiguous().transpose(1, 2),
        "longdouble": (gray / 255.0).astype(np.longdouble),
        "masked array, nothing masked": np.ma.masked_array(gray, mask=np.zeros_like(gray, bool)),
        "flipped twice": gray[:, ::-1][:, ::-1],
    }
    for name, images in forms.items():
        # values that survive the dtype: bf16 and float8 round the levels, none of them across 127.5 / 255
        assert torch.allclose(classifier.probabilities(images), want, atol=1e-6, rtol=0), name


@pytest.mark.parametrize(
    ("make", "needle"),
    [
        (lambda: torch.eye(16).to_sparse(), "torch.sparse_coo tensor; pass a dense tensor"),
        (lambda: torch.eye(16).to_sparse_csr(), "torch.sparse_csr tensor"),
        (lambda: torch.empty(16, 16, device="meta"), "meta device, which holds no values"),
        (lambda: torch.zeros(16, 16, dtype=torch.complex64), "dtype complex64"),
        (lambda: np.zeros((16, 16), dtype=np.complex128), "dtype complex128"),
        (lambda: np.array([["a"] * 16] * 16), "dtype <U1"),
        (lambda: np.full((16, 16), None), "dtype object"),
        (lambda: np.zeros((16, 16), dtype="datetime64[s]"), "dtype datetime64"),
        (lambda: np.full((16, 16), np.nan), "NaN or inf"),
        (lambda: np.full((16, 16), -np.inf, dtype=np.float32), "NaN or inf"),
        (lambda: np.full((16, 16), 1.5), r"floats in \[1.5, 1.5\]"),
        (lambda: np.full((16, 16), -1), r"integers in \[-1, -1\]"),
        (lambda: np.full((16, 16), 2**62), "integers in"),
        (lambda: np.full((16, 16), 256, dtype=np.uint16), "0..255"),
        (lambda: torch.quantize_per_tensor(torch.rand(16, 16), 0.1, 0, torch.quint8), "quantized tensor"),
        (lambda: torch.nested.nested_tensor([torch.zeros(16, 16)]), "nested tensor"),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_a_dtype_or_tensor_kind_vitmask_cannot_read_is_one_line(finetuned, make, needle):
    import warnings

    classifier = vitmask.load_classifier(finetuned)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quantized and nested tensors warn as they are made
        images = make()
    with pytest.raises(UserError, match=needle) as e:
        classifier.predict(images)
    assert "\n" not in str(e.value)


# ---- A: the processor's arguments -----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"invert": "no"}, r"invert must be True or False, got 'no' \(type str\)"),
        ({"invert": 1}, r"invert must be True or False, got 1 \(type int\)"),
        ({"invert": None}, "invert must be True or False"),
        ({"invert": [False]}, "invert must be True or False"),
        ({"threshold": "0.5"}, r"threshold must be a number in \[0, 1\], got '0.5'"),
        ({"threshold": True}, r"threshold must be a number .*type bool"),
        ({"threshold": float("nan")}, "threshold must be a number"),
        ({"threshold": 1.5}, "threshold must be a number"),
        ({"threshold": -0.0001}, "threshold must be a number"),
        ({"threshold": torch.tensor(0.5)}, "type Tensor"),
        ({"image_size": 16.0}, r"image_size must be an integer from 1 to 8192, got 16.0 \(type float\)"),
        ({"image_size": "16"}, "image_size must be an integer"),
        ({"image_size": True}, "image_size must be an integer"),
        ({"image_size": 10**6}, "image_size must be an integer from 1 to 8192, got 1000000"),
        ({"image_size": 10**5000}, "an integer of over 4000 digits"),
        ({"image_size": 0}, "image_size must be an integer from 1"),
        ({"image_size": -16}, "image_size must be an integer from 1"),
        ({"patch_size": 0}, "patch_size must be an integer from 1 to 4"),
        ({"patch_size": 8}, "patch_size must be an integer from 1 to 4, got 8"),
        ({"patch_size": 2.0}, "patch_size must be an integer"),
        ({"image_size": 15}, "image_size 15 must be divisible by patch_size 2"),
        ({"fit": "crop"}, "fit must be one of pad, resize, center_crop, none, got 'crop'"),
        ({"fit": None}, "fit must be one of"),
        ({"fit": ["pad"]}, "fit must be one of"),
    ],
    ids=case_id,
)
def test_a_processor_argument_of_another_type_or_range_is_one_line(kwargs, needle):
    args = {"image_size": 16, **kwargs}
    with pytest.raises(UserError, match=needle) as e:
        ImageProcessor(**args)
    assert "\n" not in str(e.value) and len(str(e.value)) < 200


def test_processor_arguments_of_numpy_types_are_taken_as_their_values():
    proc = ImageProcessor(np.int64(16), np.int32(2), np.float32(0.5), np.True_, "pad")
    assert proc == ImageProcessor(16, 2, 0.5, True, "pad")
    assert type(proc.image_size) is int and type(proc.invert) is bool and type(proc.threshold) is float
    gray = gray_images(1)[0]
    assert torch.equal(proc(gray).pixels[0], torch.from_numpy(1 - binary(gray)))  # inverted: once


def test_from_pretrained_reads_a_hostile_config_json_in_one_line(tmp_path):
    data = {"image_size": 16, "patch_size": 2, "threshold": 0.5, "invert": False, "fit": "pad"}
    cases = {
        "nested": '{"data": ' + "[" * 100_000 + "]" * 100_000 + "}",
        "nested-40": json.dumps({"data": data, "x": json.loads("[" * 40 + "]" * 40)}),
        "digits": '{"data": {"image_size": ' + "9" * 5000 + "}}",
        "big": json.dumps({"data": data, "pad": "x" * (1 << 20)}),
        "not-json": "{'data': 1",
        "not-utf8": b"\xff\xfe{}",
        "list": "[1, 2]",
        "data-list": '{"data": [16]}',
        "invert-string": json.dumps({"data": {**data, "invert": "false"}}),
        "size-huge": json.dumps({"data": {**data, "image_size": 10**6}}),
    }
    needles = {
        "nested": "nested more than 32 levels",
        "nested-40": "nested more than 32 levels",
        "digits": "more than 4300 digits",
        "big": "more than a config.json may be",
        "not-json": "cannot be read as JSON",
        "not-utf8": "cannot be read as JSON",
        "list": "holds no data entry",
        "data-list": "holds no data entry",
        "invert-string": "invert must be True or False",
        "size-huge": "image_size must be an integer from 1 to 8192",
    }
    for name, text in cases.items():
        folder = tmp_path / name
        folder.mkdir()
        file = folder / "config.json"
        file.write_bytes(text if isinstance(text, bytes) else text.encode())
        with pytest.raises(UserError, match=needles[name]) as e:
            ImageProcessor.from_pretrained(folder)
        assert "\n" not in str(e.value) and "export the model again" in str(e.value), name
    with pytest.raises(UserError, match="from_pretrained's path must be a path .*got type int"):
        ImageProcessor.from_pretrained(3)
    with pytest.raises(UserError, match="takes a Config or a DataConfig"):
        ImageProcessor.from_config({"data": data})
    with pytest.raises(UserError, match="the data entry is of type list"):
        ImageProcessor.from_dict([16])


# ---- A: loaders ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("device", "needle"),
    [
        ("tpu", "device 'tpu' is not a device"),
        ("cuda:x", "is not a device"),
        ("", "is not a device"),
        ("meta", "device 'meta' is not one vitmask runs models on"),
        ("xpu", "device 'xpu' is not one vitmask runs models on"),
        (torch.device("meta"), "device 'meta' is not one"),
        ("cuda", "torch sees no CUDA GPU here"),
        ("cuda:3", "torch sees no CUDA GPU here"),
        (0, "must be a str or a torch.device .*got type int"),
        (None, "got type NoneType"),
    ],
    ids=str,
)
def test_a_device_a_loader_cannot_use_is_refused_before_anything_is_read(monkeypatch, tmp_path, device, needle):
    """The device is checked first: a path that does not exist is never looked at."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    missing = tmp_path / "none"
    for load in (vitmask.load_classifier, vitmask.load_masked_model, vitmask.load_pretrained):
        with pytest.raises(UserError, match=needle) as e:
            load(missing, device=device)
        assert "\n" not in str(e.value), load


def test_a_cuda_device_beyond_the_count_is_refused(monkeypatch, tmp_path):
    from vitmask.runtime.process import api_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert api_device("cuda:1") == torch.device("cuda:1")
    assert api_device(torch.device("cuda")) == torch.device("cuda")
    assert api_device("auto") == torch.device("cuda")
    with pytest.raises(UserError, match=r"'cuda:2': torch sees 2 CUDA GPU\(s\), cuda:0 to cuda:1"):
        vitmask.load_classifier(tmp_path / "none", device="cuda:2")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert api_device("auto") == torch.device("cpu") == api_device(torch.device("cpu")) == api_device("cpu:0")


def test_loader_paths_and_weights_of_another_type_are_one_line(finetuned, pretrained, exported):
    for load in (vitmask.load_classifier, vitmask.load_masked_model, vitmask.load_pretrained):
        for path, needle in (
            (None, "got type NoneType"),
            (3, "got type int"),
            (b"last.pt", "got type bytes"),
            ("", "path is an empty path"),
            ("  ", "path is an empty path"),
            ("a\x00b.pt", "path holds a NUL character"),
            ("x" * 5000, "cannot be looked at"),
        ):
            with pytest.raises(UserError, match=needle):
                load(path)
    for load in (vitmask.load_classifier, vitmask.load_masked_model):
        for weights, needle in ((1, r"got 1 \(type int\)"), (True, "type bool"), ("best", "must be ema or raw")):
            with pytest.raises(UserError, match=needle):
                load(finetuned if load is vitmask.load_classifier else pretrained, weights=weights)
    with pytest.raises(UserError, match="got type list"):
        vitmask.load_pretrained([exported])
    model = vitmask.load_pretrained(exported, device="auto" if not torch.cuda.is_available() else "cpu")
    assert next(model.parameters()).device == CPU
    classifier = vitmask.load_classifier(finetuned)
    with pytest.raises(UserError, match="device 'tpu'"):
        classifier.to("tpu")
    with pytest.raises(UserError, match="device 'tpu'"):
        vitmask.load_masked_model(pretrained).to("tpu")
    assert classifier.device == CPU  # nothing moved


@pytest.mark.parametrize(
    ("top_k", "needle"),
    [
        (2.5, r"top_k must be an integer from 1 to 4, got 2.5"),
        ("2", "top_k must be an integer"),
        (True, "top_k must be an integer"),
        (None, "top_k must be an integer"),
        (0, "top_k 0 is out of range"),
        (5, "top_k 5 is out of range: the classifier has 4 classes"),
        (-1, "top_k -1 is out of range"),
        (10**100, "top_k an integer of 101 digits is out of range"),
    ],
    ids=str,
)
def test_top_k_of_another_type_or_range_is_one_line(finetuned, top_k, needle):
    classifier = vitmask.load_classifier(finetuned)
    with pytest.raises(UserError, match=needle):
        classifier.predict(gray_images(1)[0], top_k=top_k)


def test_top_k_as_a_numpy_integer_is_its_value(finetuned):
    classifier = vitmask.load_classifier(finetuned)
    top = classifier.predict(gray_images(2), top_k=np.int64(3))
    assert top.probabilities.shape == (2, 3) and top.classes.dtype == torch.int64
    with pytest.raises(UserError, match=r"top_k 0 is out of range"):  # a numpy scalar shown as its value
        classifier.predict(gray_images(2), top_k=np.int64(0))


def test_top_k_of_probabilities_checks_k_and_their_shape_as_predict_does(finetuned):
    classifier = vitmask.load_classifier(finetuned)
    probabilities = classifier.probabilities(gray_images(2))  # (2, 4)
    assert classifier.top_k(probabilities, 4).classes.shape == (2, 4)
    with pytest.raises(UserError, match="top_k 5 is out of range: the classifier has 4 classes"):
        classifier.top_k(probabilities, 5)
    with pytest.raises(UserError, match=r"probabilities of shape \(2, 3\) are not a tensor of shape \(images, 4\)"):
        classifier.top_k(probabilities[:, :3], 1)
    with pytest.raises(UserError, match=r"probabilities of type ndarray are not a tensor"):
        classifier.top_k(probabilities.numpy(), 1)


# ---- A: processed images and masks ---------------------------------------------------------------------
def test_processed_images_of_another_size_or_kind_are_refused_naming_the_size(finetuned, pretrained):
    classifier = vitmask.load_classifier(finetuned)
    masked = vitmask.load_masked_model(pretrained)
    other = ImageProcessor(20, fit="pad")(gray_images(2, 20, 20))
    for call in (classifier.predict, classifier.logits, classifier.features, masked.features):
        with pytest.raises(UserError, match=r"are 20x20 pixels, but the model takes 16x16; .*fit="):
            call(other)
    with pytest.raises(UserError, match="20x20 pixels, but the model takes 16x16"):
        masked.logits(other, torch.zeros(64, dtype=torch.bool))
    good = classifier.processor(gray_images(2))
    with pytest.raises(UserError, match="fitted already: leave fit out"):
        classifier.predict(good, fit="pad")
    with pytest.raises(UserError, match="other than 0 and 1"):
        classifier.predict(ProcessedImages(good.pixels * 255, 2))
    with pytest.raises(UserError, match="hold no images"):
        classifier.predict(ProcessedImages(torch.zeros(0, 16, 16, dtype=torch.uint8), 2))
    for pixels, needle in (
        (np.zeros((1, 16, 16), np.uint8), "pixels is of type ndarray"),
        (torch.zeros(16, 16, dtype=torch.uint8), r"shape \(16, 16\)"),
        (torch.zeros(1, 16, 12, dtype=torch.uint8), r"shape \(1, 16, 12\)"),
        (torch.zeros(1, 16, 16), "dtype torch.float32"),
    ):
        with pytest.raises(UserError, match=needle):
            ProcessedImages(pixels, 2)
    with pytest.raises(UserError, match="16-pixel images do not cut into 3x3 patches"):
        ProcessedImages(good.pixels, 3)
    with pytest.raises(UserError, match="patch_size must be an integer from 1 to 4"):
        ProcessedImages(good.pixels, 2.0)
    # processed images of the model's size, from a bool tensor: what the processor gives
    top = classifier.predict(ProcessedImages(good.pixels.bool(), 2))
    assert torch.equal(top.probabilities, classifier.predict(good).probabilities) and top.fit is None


@pytest.mark.parametrize(
    ("mask", "needle"),
    [
        (None, "the mask is of type NoneType; pass one patch mask \\(64,\\)"),
        (torch.full((64,), 0.5), "holds torch.float32 values other than 0 and 1"),
        (torch.ones(64), "holds torch.float32 values"),
        (torch.full((64,), 2), "holds torch.int64 values other than 0 and 1"),
        (torch.zeros(3, 64, dtype=torch.bool), r"the mask has shape \(3, 64\)"),
        (torch.zeros(63, dtype=torch.bool), r"shape \(63,\)"),
        (torch.zeros(2, 8, 8, dtype=torch.bool), r"shape \(2, 8, 8\)"),
        (torch.tensor(True), r"shape \(\)"),
        ("all", "the mask is of type str"),
        (7, "the mask is of type int"),
        ([[True, False], [True]], "cannot be read as an array of bools"),
        (torch.empty(64, dtype=torch.bool, device="meta"), "on the meta device"),
        (torch.zeros(64, dtype=torch.bool).to_sparse(), "torch.sparse_coo tensor"),
        ([], r"the mask is empty \(shape \(0,\)\)"),
        ((), "the mask is empty"),
        (np.zeros((2, 0), bool), r"the mask is empty \(shape \(2, 0\)\)"),
    ],
    ids=case_id,
)
def test_a_mask_that_is_not_one_or_b_rows_of_bools_is_one_line(pretrained, mask, needle):
    model = vitmask.load_masked_model(pretrained)
    images = gray_images(2)
    for call in (model.logits, model.fill):
        with pytest.raises(UserError, match=needle) as e:
            call(images, mask)
        assert "\n" not in str(e.value)


def test_a_mask_of_integers_or_lists_is_read_as_bools(pretrained):
    model = vitmask.load_masked_model(pretrained)
    images = gray_images(2)
    hidden = torch.zeros(64, dtype=torch.bool)
    hidden[::3] = True
    want = model.logits(images, hidden)
    for mask in (hidden.to(torch.uint8), hidden.numpy(), hidden.tolist(), hidden.expand(2, -1).numpy().astype(">i4")):
        assert torch.equal(model.logits(images, mask), want)


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"pool": "max"}, "pool must be one of mean, grid, got 'max'"),
        ({"pool": None}, "pool must be one of"),
        ({"grid": "2"}, r"grid must be an integer or None, got '2' \(type str\)"),
        ({"grid": 2.0}, "grid must be an integer"),
        ({"grid": 0}, "grid=0 is not a cell count"),  # named as the arguments they are, not the CLI's flags
        ({"grid": 9}, "grid=9 is not a cell count for the 8x8 patch grid"),
        ({"pool": "mean", "grid": 2}, "grid=2 needs pool='grid'"),
        ({"layer": "1"}, "layer must be None, an integer or a list of integers, got '1'"),
        ({"layer": [1, "2"]}, "layer must be None"),
        ({"layer": 1.0}, "layer must be None"),
        ({"layer": 3}, "layer=3 is out of range: the model has 2 blocks"),
        ({"layer": -1}, "layer=-1 is out of range"),
        ({"layer": []}, r"layer=\[\] names no layer; leave layer=None"),
        ({"layer": ()}, r"layer=\(\) names no layer"),
        ({"fit": "stretch"}, "fit must be one of pad, resize, center_crop, none, got 'stretch'"),
    ],
    ids=str,
)
def test_feature_arguments_of_another_type_or_range_are_one_line(pretrained, kwargs, needle):
    model = vitmask.load_masked_model(pretrained)
    with pytest.raises(UserError, match=needle):
        model.features(gray_images(1), **kwargs)


def test_layer_none_is_the_final_normalised_tokens(pretrained):
    """The default, None, is the encoder's final normalised tokens: not any block's raw output."""
    model = vitmask.load_masked_model(pretrained)
    images = gray_images(3)
    final = model.features(images, layer=None, pool="mean")
    assert torch.equal(final, model.features(images, pool="mean"))
    patches = model.processor(images).patches.to(model.device)
    with torch.no_grad():
        want = model.model.forward_encoder(patches).mean(1).cpu()
    assert torch.allclose(final, want, atol=1e-6)
    assert not torch.allclose(final, model.features(images, layer=2, pool="mean"))


def test_an_empty_list_of_layers_is_refused_by_the_probes_too():
    from vitmask.evaluate.probe import check_layer
    from vitmask.model.pooling import as_layers

    for empty in ([], ()):
        with pytest.raises(UserError, match="names no layer"):
            check_layer(empty, 2)
        with pytest.raises(ValueError, match="names no layer"):
            as_layers(empty)
    assert as_layers(None) == (None,) and as_layers([2, 1]) == (2, 1)


def test_feature_layers_as_numpy_integers_or_a_list_are_their_values(pretrained):
    model = vitmask.load_masked_model(pretrained)
    images = gray_images(2)
    one = model.features(images, layer=1)
    assert torch.equal(model.features(images, layer=np.int64(1)), one)
    both = model.features(images, layer=[1, np.int32(2)], grid=np.int64(4))
    assert torch.equal(both[:, : one.shape[1]], one)
    assert torch.equal(both[:, one.shape[1] :], model.features(images, layer=2))


def test_fill_of_an_invert_model_inverts_the_images_once():
    """A model trained with data.invert: fill sees the images inverted once, as training did, and
    keeps the visible patches as those pixels; its binary pixels are not binarized (inverted) again."""
    from vitmask.inference.masked import MaskedModel

    cfg = config_from_dict({**TINY, "data": {**TINY["data"], "invert": True}})
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    with torch.no_grad():  # larger weights, so that what the model sees changes what it predicts
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.5)
    gray = gray_images(3, seed=5)
    once = 1 - binary(gray)  # what the model sees: the threshold, then inverted
    hidden = torch.zeros(64, dtype=torch.bool)
    hidden[::3] = True
    with torch.no_grad():
        classes = model(hand_patches(once), hidden.expand(3, -1)).argmax(-1)  # (3, 64)
        twice = model(hand_patches(binary(gray)), hidden.expand(3, -1)).argmax(-1)
    assert not torch.equal(classes[:, hidden], twice[:, hidden])  # inverting twice would show
    got = MaskedModel(model, cfg).fill(gray, hidden)
    bits = ((classes.unsqueeze(-1) >> torch.arange(3, -1, -1)) & 1).float()  # class 8a + 4b + 2c + d: [a, b, c, d]
    want = torch.where(hidden[None, :, None], bits, hand_patches(once))
    assert torch.equal(hand_patches(got), want)


def test_an_encoder_only_export_refuses_fill_and_logits_in_one_line(pretrained, tmp_path):
    from vitmask.store.export import export

    out = tmp_path / "enc"
    export(pretrained, out, encoder_only=True)
    model = vitmask.load_masked_model(out)
    hidden = torch.zeros(64, dtype=torch.bool)
    for call in (model.fill, model.logits):
        with pytest.raises(UserError, match="encoder only"):
            call(gray_images(1), hidden)
    assert model.features(gray_images(1)).shape == (1, 16 * 32)


# ---- B: fitting images of another size -----------------------------------------------------------------
def pad_or_crop(gray: np.ndarray, size: int = 16) -> np.ndarray:
    """(n, h, w) -> (n, size, size): centred on a black canvas, the centre cut where a side is longer."""
    n, h, w = gray.shape
    out = np.zeros((n, size, size), gray.dtype)
    ch, cw = min(h, size), min(w, size)
    out[:, (size - ch) // 2 : (size - ch) // 2 + ch, (size - cw) // 2 : (size - cw) // 2 + cw] = gray[
        :, (h - ch) // 2 : (h - ch) // 2 + ch, (w - cw) // 2 : (w - cw) // 2 + cw
    ]
    return out


def torch_resize(gray: np.ndarray, size: int = 16) -> np.ndarray:
    x = F.interpolate(torch.from_numpy(gray).float()[:, None], size=(size, size), mode="bilinear", antialias=True)
    return x[:, 0].round().clamp(0, 255).to(torch.uint8).numpy()


def test_python_fits_another_size_only_when_asked_and_says_which_fit(fit_none):
    classifier = vitmask.load_classifier(fit_none)
    assert classifier.processor.fit == "none"
    big, small = gray_images(2, 20, 22, seed=5), gray_images(1, 10, 12, seed=6)
    with pytest.raises(
        UserError, match=r"20x22 pixels, but the model takes 16x16 images and the fit is none; .*fit='pad'"
    ):
        classifier.predict(big)
    with pytest.raises(UserError, match=r"image 1: 10x12 pixels, .*vitmask predict --fit"):
        classifier.predict([gray_images(1)[0], small[0]])
    for fit, fitted in (("pad", pad_or_crop), ("center_crop", pad_or_crop), ("resize", torch_resize)):
        for images in (big, small):
            top = classifier.predict(images, top_k=4, fit=fit)
            assert top.fit == fit
            want = hand_probabilities(fit_none, binary(fitted(images)))
            assert torch.allclose(top.probabilities, want.sort(descending=True).values, atol=1e-6, rtol=0), fit
    mixed = classifier.predict([big[0], small[0], gray_images(1)[0]], fit="pad")
    want = torch.cat([classifier.probabilities(pad_or_crop(x[None])) for x in (big[0], small[0])])
    assert torch.allclose(mixed.probabilities[:2, 0], want.max(1).values, atol=1e-6, rtol=0)
    # images of the model's size need no fit; the model's own is named
    assert classifier.predict(gray_images(2)).fit == "none"
    assert torch.equal(classifier.logits(gray_images(2), fit="resize"), classifier.logits(gray_images(2)))
    with pytest.raises(UserError, match="fit must be one of pad, resize, center_crop, none, got 'crop'"):
        classifier.predict(big, fit="crop")
    with pytest.raises(UserError, match="fit must be one of"):
        classifier.features(big, fit=True)


def test_the_masked_model_fits_another_size_when_asked(pretrained, tmp_path):
    model = vitmask.load_masked_model(pretrained)  # trained with fit pad
    big = gray_images(1, 24, 24, seed=7)
    assert torch.equal(model.pixels(big), torch.from_numpy(binary(pad_or_crop(big))))
    assert torch.equal(model.pixels(big, fit="resize"), torch.from_numpy(binary(torch_resize(big))))
    with pytest.raises(UserError, match="24x24 pixels, but the model takes 16x16 images and the fit is none"):
        model.features(big, fit="none")


def read_csv(path):
    with open(path) as f:
        return list(csv.DictReader(f))


def test_predict_fits_another_size_only_with_fit_and_records_it(run_cli, fit_none, tmp_path):
    folder = tmp_path / "images"
    folder.mkdir()
    big, small = gray_images(2, 20, 20, seed=8), gray_images(1, 12, 14, seed=9)
    for i, image in enumerate([*big, *small]):
        Image.fromarray(image.astype(np.uint8)).save(folder / f"{i}.png")
    out = tmp_path / "p.csv"
    res = run_cli("predict", "--checkpoint", fit_none, "--input", folder, "--out", out)
    assert_user_error(res, "0.png: 20x20 pixels, but the model takes 16x16", "--fit")
    assert not out.exists()
    np.savez(tmp_path / "x.npz", images=big)
    res = run_cli("predict", "--checkpoint", fit_none, "--input", tmp_path / "x.npz", "--out", out)
    assert_user_error(res, "x.npz: 20x20 pixels", "the fit is none", "--fit")
    assert_user_error(
        run_cli("predict", "--checkpoint", fit_none, "--input", folder, "--out", out, "--fit", "crop"),
        "--fit must be one of pad, resize, center_crop, none, got 'crop'",
    )

    res = run_cli("predict", "--checkpoint", fit_none, "--input", folder, "--out", out, "--fit", "pad", "--top-k", "2")
    assert res.returncode == 0, res.stderr
    assert "images of another size fitted by pad" in res.stdout
    rows = read_csv(out)
    assert list(rows[0]) == ["name", "class_1", "probability_1", "class_2", "probability_2", "fit"]
    assert [r["fit"] for r in rows] == ["pad"] * 3
    fitted = np.concatenate([pad_or_crop(big), pad_or_crop(small)])
    want = hand_probabilities(fit_none, binary(fitted))
    got = torch.tensor([[float(r["probability_1"]), float(r["probability_2"])] for r in rows])
    assert torch.allclose(got, want.sort(descending=True).values[:, :2], atol=1e-6, rtol=0)

    out_json = tmp_path / "p.json"
    res = run_cli(
        "predict", "--checkpoint", fit_none, "--input", tmp_path / "x.npz", "--out", out_json, "--fit", "resize"
    )
    assert res.returncode == 0, res.stderr
    records = json.loads(out_json.read_text())
    assert [r["fit"] for r in records] == ["resize", "resize"]
    want = hand_probabilities(fit_none, binary(torch_resize(big)))
    assert [r["probabilities"][0] for r in records] == pytest.approx(want.max(1).values.tolist(), abs=1e-6)
    # without --fit the record has no fit entry: the model's own preprocessing
    same = tmp_path / "same.npz"
    np.savez(same, images=gray_images(2))
    res = run_cli("predict", "--checkpoint", fit_none, "--input", same, "--out", tmp_path / "q.json")
    assert res.returncode == 0 and "fit" not in json.loads((tmp_path / "q.json").read_text())[0]


def test_predict_refuses_fit_for_a_pack(run_cli, finetuned, tmp_path):
    from tests.conftest import write_config

    pack = tmp_path / "pack"
    assert run_cli("pack", "--config", write_config(tmp_path / "t.yaml"), "--out", pack).returncode == 0
    res = run_cli("predict", "--checkpoint", finetuned, "--input", pack, "--out", tmp_path / "p.csv", "--fit", "pad")
    assert_user_error(res, "--fit fits images, folders and .npz archives", "leave --fit out")
    assert not (tmp_path / "p.csv").exists()
