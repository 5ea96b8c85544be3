"""`moga data fetch` and the search order of moga.data.paths, on real files (file:// sources, no network)."""

import hashlib
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from moga.cli import app
from moga.data import resolve_text_corpus
from moga.data.fetch import REMOTES, FetchError, fetch
from moga.data.images import locate_image_data
from moga.data.paths import dataset_candidates


def test_fetch_checks_size_and_checksum_before_writing(tmp_path):
    wrong = tmp_path / "wrong.txt"
    wrong.write_text("To be, or not to be\n")
    dest = tmp_path / "data"
    with pytest.raises(FetchError, match="expected 1115394 bytes"):
        fetch("shakespeare", dest, url=wrong.as_uri())
    assert not dest.exists() or not any(dest.iterdir())


def test_fetch_failure_says_what_to_do(tmp_path):
    with pytest.raises(FetchError, match=r"could not download shakespeare .*\$MOGA_DATA as tinyshakespeare.txt"):
        fetch("shakespeare", tmp_path, url=(tmp_path / "absent.txt").as_uri())
    result = CliRunner().invoke(app, ["data", "fetch", "sonnets"])
    assert result.exit_code == 1 and "knows: shakespeare" in result.output
    # the console script's lazy group too (it once made `moga data` the fetch command itself)
    run = subprocess.run([sys.executable, "-m", "moga", "data", "fetch", "sonnets"], capture_output=True, text=True)
    assert run.returncode == 1 and "knows: shakespeare" in run.stderr + run.stdout, run.stderr


def test_fetched_text_is_where_the_loader_looks(tmp_path, monkeypatch):
    source = tmp_path / "copy.txt"
    text = _shakespeare_or_skip()
    source.write_bytes(text)
    monkeypatch.delenv("MOGA_TEXT", raising=False)
    monkeypatch.delenv("MOGA_DATA", raising=False)
    monkeypatch.setenv("MOGA_CACHE", str(tmp_path / "cache"))
    result = CliRunner().invoke(app, ["data", "fetch", "shakespeare", "--url", source.as_uri()])
    assert result.exit_code == 0, result.output
    found = resolve_text_corpus()
    assert found == tmp_path / "cache" / "data" / "tinyshakespeare.txt"
    assert hashlib.sha256(found.read_bytes()).hexdigest() == REMOTES["shakespeare"].sha256


def test_moga_data_comes_before_the_user_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("MOGA_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("MOGA_DATA", str(tmp_path / "datasets"))
    monkeypatch.delenv("MOGA_CIFAR100", raising=False)
    assert dataset_candidates("x") == [tmp_path / "datasets" / "x", tmp_path / "cache" / "data" / "x"]
    for where in (tmp_path / "cache" / "data", tmp_path / "datasets"):
        (where / "cifar-100-python").mkdir(parents=True)
        assert locate_image_data("cifar100") == where / "cifar-100-python"
    with pytest.raises(FileNotFoundError, match=r"MOGA_DATA"):
        locate_image_data("cifar100", tmp_path / "nowhere")


def _shakespeare_or_skip() -> bytes:
    for path in dataset_candidates("tinyshakespeare.txt"):
        if path.is_file():
            return path.read_bytes()
    pytest.skip("tiny Shakespeare not found: set MOGA_DATA to a directory holding tinyshakespeare.txt")
