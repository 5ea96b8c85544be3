"""Hardware facts: detected once, overridden by $MOGA_ASSUME and by assume() blocks (innermost wins)."""

import subprocess
import sys

import pytest
import torch

from moga.hardware import assume, detected, facts
from moga.kernels import fused_available
from moga.orthogonalize import compute_dtype


def test_assume_blocks_nest_and_restore():
    found = facts()  # detected, or as $MOGA_ASSUME sets it
    with assume(bf16_matmul=not found.bf16_matmul) as outer:
        assert outer.bf16_matmul is not found.bf16_matmul and outer.compiler is found.compiler
        with assume(bf16_matmul=found.bf16_matmul, compiler=False):
            assert facts().bf16_matmul is found.bf16_matmul and not facts().compiler
        assert facts() == outer
    assert facts() == found


def test_environment_sets_facts_for_the_process_and_assume_overrides_it(monkeypatch):
    monkeypatch.setenv("MOGA_ASSUME", "bf16_matmul=1, compiler=0")
    assert facts().bf16_matmul and not facts().compiler
    assert compute_dtype("auto", torch.device("cpu")) == torch.bfloat16
    with assume(bf16_matmul=False):
        assert compute_dtype("auto", torch.device("cpu")) == torch.float32
    monkeypatch.setenv("MOGA_ASSUME", "bf16=1")
    with pytest.raises(ValueError, match="MOGA_ASSUME.*bf16_matmul"):
        facts()


def test_assume_refuses_unknown_names_and_non_booleans():
    with pytest.raises(ValueError, match="bf16_matmul"):
        with assume(amx=True):
            pass
    with pytest.raises(ValueError, match="True/False"):
        with assume(compiler=1):
            pass


def test_no_compiler_means_the_plain_path_or_a_clear_error():
    with assume(compiler=False):
        assert fused_available("torch", torch.device("cpu")) is False
        with pytest.raises(RuntimeError, match="kernel='cpp'.*no C\\+\\+ compiler"):
            fused_available("cpp", torch.device("cpu"))
    assert fused_available("cpp", torch.device("cuda"))  # CUDA steps in plain torch through the op: no tool needed


def test_traced_as_constant_marks_a_function_as_torch_compiler_does():
    from moga.hardware import traced_as_constant

    def ours():
        return 1

    def torchs():
        return 1

    assert traced_as_constant(ours) is ours
    assert torch.compiler.assume_constant_result(torchs) is torchs
    assert vars(ours) == vars(torchs) and vars(ours)  # the same marks, and some mark


def test_import_moga_does_not_load_torch_dynamo():
    """torch._dynamo costs about 1 s, half of `import moga`; only a compile needs it."""
    code = "import sys, moga; from moga import MOGA, Muon; print('torch._dynamo' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
