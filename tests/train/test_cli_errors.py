"""Bad input to `moga train` ends in one line that says what is wrong, never in a traceback."""

import pickle

import pytest
from typer.testing import CliRunner

from .conftest import one_line, tiny


def _train(tmp_path, *overrides: str):
    import typer

    from moga.train.cli import train

    app = typer.Typer(add_completion=False)
    app.command("train")(train)
    app.command("other")(lambda: None)  # two commands: "train" is then a subcommand, as in `moga`
    base = ["train.steps=1", "logging.progress=false"]
    if not any(o.startswith("model.name=") for o in overrides):
        base += ["model.width=8", "model.depth=1"]
    return CliRunner().invoke(app, ["train", *base, *overrides, "-o", str(tmp_path / "run")], terminal_width=200)


def test_an_allocation_that_fails_says_out_of_memory(tmp_path):
    # 2^60 float32 weights (4 EiB): larger than any address space, so the allocator refuses at once, everywhere
    result = _train(tmp_path, "model.name=torch.nn:Linear", "model.in_features=1073741824",
                    "model.out_features=1073741824")
    one_line(result, 1, "out of memory (one tensor of 4.29e+09 GiB)", "model.width")


def test_a_cuda_device_without_cuda(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    one_line(_train(tmp_path, "train.device=cuda"), 2, "train.device=cuda but", "no CUDA device")
    one_line(_train(tmp_path, "train.device=gpu"), 2, "train.device='gpu' is not a device")


def test_an_unknown_compile_backend(tmp_path):
    one_line(_train(tmp_path, "train.compile=bogus"), 2, "train.compile='bogus' is not a torch.compile backend",
              "inductor")


def test_a_seed_beyond_what_the_generators_take(tmp_path):
    result = _train(tmp_path, "seed=1180591620717411303424")  # 2**70
    assert result.exit_code == 2 and "seed" in result.output and "4294967295" in result.output, result.output
    assert "Traceback" not in result.output and "Overflow" not in result.output


def test_a_hostile_meta_pickle_is_refused_inone_line(tmp_path):
    import os

    import numpy as np

    marker = tmp_path / "ran"

    class Hostile:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)

    data = tmp_path / "data"
    data.mkdir()
    for split in ("train", "val"):
        np.arange(500, dtype=np.uint16).tofile(data / f"{split}.bin")
    (data / "meta.pkl").write_bytes(pickle.dumps(Hostile()))
    result = _train(tmp_path, "data.name=text", f"data.data_dir={data}", "model.name=gpt", "model.n_layer=1",
                    "model.n_embd=8", "model.n_head=1")
    one_line(result, 2, f"{data / 'meta.pkl'}: refused", "nothing in it was run")
    assert not marker.exists()


def test_an_empty_text_file_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv("MOGA_CACHE", str(tmp_path / "cache"))
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    result = _train(tmp_path, "data.name=text", f"data.text_path={empty}", "model.name=gpt", "model.n_layer=1",
                    "model.n_embd=8", "model.n_head=1")
    one_line(result, 2, f"{empty} is empty")
