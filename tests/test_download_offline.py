"""A torchvision download without a network: one line that says the download failed (not "check
data.path"), how to point vitmask at local files, exit 2, and no folder left behind. The network is
cut by making urllib's urlopen, which torchvision's downloader calls, fail as it fails offline: no test
here reaches the network."""

import urllib.error
import urllib.request

import pytest

from tests.conftest import assert_user_error
from tests.test_sources import preview_args, run_inproc, tiny_cfg_file  # noqa: F401 (a fixture)


@pytest.fixture
def offline(monkeypatch):
    """urlopen fails as it does without a network; the URLs torchvision tried are kept."""
    tried = []

    def unreachable(request, *args, **kwargs):
        tried.append(getattr(request, "full_url", request))
        raise urllib.error.URLError(OSError(-3, "Temporary failure in name resolution"))

    monkeypatch.setattr(urllib.request, "urlopen", unreachable)
    return tried


@pytest.mark.parametrize("name", ["MNIST", "FashionMNIST", "EMNIST", "Omniglot"])
def test_an_offline_download_says_the_network_failed_and_how_to_use_local_files(
    name,
    offline,
    tmp_path,
    capsys,
    tiny_cfg_file,  # noqa: F811
):
    root = tmp_path / "data" / "mnist"
    sets = (f"data.name={name}", "data.download=true")
    res = run_inproc(capsys, *preview_args(tmp_path, "torchvision", root, *sets), "-c", tiny_cfg_file)
    assert offline, "torchvision never asked for a URL"
    assert_user_error(res, f"could not download torchvision dataset {name}", "network is unreachable", "copy")
    assert "check data.path" not in res.stderr
    # the idx source reads MNIST's and Fashion-MNIST's files as they are, not EMNIST's or Omniglot's
    assert ("--set data.source=idx --set data.path=DIR" in res.stderr) == (name in ("MNIST", "FashionMNIST"))
    assert not (tmp_path / "data").exists(), "the failed download left its folders behind"
    assert not (tmp_path / "p.png").exists()


def test_a_failed_download_keeps_the_folders_that_were_there(offline, tmp_path, capsys, tiny_cfg_file):  # noqa: F811
    root = tmp_path / "data" / "mnist"
    (root / "other").mkdir(parents=True)
    (root / "other" / "keep.txt").write_text("mine")
    res = run_inproc(capsys, *preview_args(tmp_path, "torchvision", root, "data.download=true"), "-c", tiny_cfg_file)
    assert_user_error(res, "network is unreachable")
    assert sorted(p.name for p in root.iterdir()) == ["other"]  # MNIST/raw made and removed again
    assert (root / "other" / "keep.txt").read_text() == "mine"
