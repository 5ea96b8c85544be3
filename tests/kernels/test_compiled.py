"""The CUDA kernel (the compiled reference step), run here by inductor's C++ backend on CPU tensors: it
equals the reference for the row and the col layout, compiles once per layout across learning rates and
shapes, makes no tensor per call, and a failed compile falls back to plain torch once, with one warning."""

import os
import subprocess
import sys
import textwrap
import warnings

import torch

from moga.kernels import compiled, reference


def test_row_and_col_layouts_compile_once_each_and_equal_the_reference():
    # The row layout with momentum failed in inductor (KeyError 'buf5'); lr-dependent numbers as tensors
    # made a host-to-device copy per parameter. Python floats: one graph per layout for every lr.
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    compiled._failed.clear()
    gen = torch.Generator().manual_seed(4)
    cases = [((33, 40), "row", -0.01, 0.99, 0.0), ((7, 13), "row", -0.03, 0.97, 1.0), ((9, 5), "row", -0.02, 1.0, 0.0),
             ((33, 40), "col", -0.01, 0.99, 0.0), ((5, 9), "col", -0.02, 0.98, 1.0), ((12, 6), "col", -0.05, 1.0, 0.0)]
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a fallback warns: it must not happen here
        for (rows, cols), layout, scale, decay, flag in cases:
            w, g, m = (torch.randn(rows, cols, generator=gen) for _ in range(3))
            found_inf = torch.tensor(flag)  # the optimizer passes a flag on every step, or never (None)
            shape = [rows, cols, 1] if layout == "row" else [1, rows, cols]
            args = (shape, [scale], 2.0, 0.9, True, decay)
            mine, ref = ([w.clone()], [m.clone()]), ([w.clone()], [m.clone()])
            compiled.compiled_steps_(mine[0], [g], mine[1], found_inf, *args)
            reference.tensor_steps_(ref[0], [g], ref[1], found_inf, *args)
            torch.testing.assert_close(mine[0][0], ref[0][0], rtol=0, atol=1e-6)
            torch.testing.assert_close(mine[1][0], ref[1][0], rtol=0, atol=1e-6)
            assert torch.equal(mine[0][0], w) == bool(flag) and torch.equal(mine[1][0], m) == bool(flag)
    assert not compiled._failed
    assert counters["stats"]["unique_graphs"] == 2  # row and col: no recompile for lr, decay or shape


def test_the_compiled_step_gets_python_numbers_and_the_callers_tensors(monkeypatch):
    # What reaches the compiled function decides what happens on the device per call: a tensor made
    # here (torch.tensor(c, device=...)) is a blocking host-to-device copy per parameter per step.
    seen = []
    monkeypatch.setattr(compiled, "compiled_step", lambda: lambda *args: seen.append(args))
    ws, gs, ms = ([torch.randn(4, 6) for _ in range(3)] for _ in range(3))
    ws = [torch.nn.Parameter(w) for w in ws]  # what an optimizer holds
    flag = torch.zeros(())
    compiled.compiled_steps_(ws, gs, ms, flag, [4, 6, 1] * 3, [-0.1, -0.2, -0.3], 2.0, 0.9, False, 0.99)
    ours = {t.data_ptr() for t in (*ws, *gs, *ms, flag)}
    assert len(seen) == 3
    for args in seen:
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        assert len(tensors) == 4 and all(t.data_ptr() in ours for t in tensors)  # their storage: no copy
        assert not any(isinstance(t, torch.nn.Parameter) for t in tensors)
        assert all(type(a) in (float, bool, tuple) for a in args if not isinstance(a, torch.Tensor))


def test_parameters_of_every_shape_share_one_graph():
    # dynamo keeps a Parameter's sizes static: passed as they are, each shape of a transformer compiled anew
    # until the recompile limit stopped the step (seen on a GPU); detached, one graph serves them all
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    compiled._failed.clear()
    gen = torch.Generator().manual_seed(5)
    for rows, cols in [(24, 8), (8, 8), (32, 8), (8, 32), (13, 8)]:
        w = torch.nn.Parameter(torch.randn(rows, cols, generator=gen))
        g, m = torch.randn(rows, cols, generator=gen), torch.randn(rows, cols, generator=gen)
        ref_w, ref_m = w.detach().clone(), m.clone()
        args = ([1, rows, cols], [-0.01], 2.0, 0.9, True, 1.0)
        with torch.no_grad():
            compiled.compiled_steps_([w], [g], [m], None, *args)
        reference.tensor_steps_([ref_w], [g], [ref_m], None, *args)
        torch.testing.assert_close(w.detach(), ref_w, rtol=0, atol=1e-6)
        torch.testing.assert_close(m, ref_m, rtol=0, atol=1e-6)
    assert not compiled._failed and counters["stats"]["unique_graphs"] == 1


FALLBACK = textwrap.dedent("""
    import warnings, torch
    from torch._dynamo.utils import counters
    from moga.kernels import compiled, reference
    gen = torch.Generator().manual_seed(0)
    w, g, m = (torch.randn(6, 5, generator=gen) for _ in range(3))
    args = ([6, 5, 1], [-0.01], 2.0, 0.9, False, 0.99)
    mine, ref = ([w.clone()], [m.clone()]), ([w.clone()], [m.clone()])
    captured = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            compiled.compiled_steps_(mine[0], [g], mine[1], None, *args)
            reference.tensor_steps_(ref[0], [g], ref[1], None, *args)
            captured.append(counters["stats"]["calls_captured"])
    messages = [str(x.message) for x in caught if "compiled" in str(x.message)]
    assert len(messages) == 1 and "plain torch" in messages[0] and "\\n" not in messages[0], messages
    assert captured[0] > 0 and captured[1] == captured[2] == captured[0], captured  # decided once
    assert torch.equal(mine[0][0], ref[0][0]) and torch.equal(mine[1][0], ref[1][0])
    print("fallback ok")
""")


def test_a_failed_compile_steps_in_plain_torch_and_warns_once(tmp_path):
    # No working C++ compiler for inductor (as a GPU machine without a working triton): the step still runs.
    env = {**os.environ, "CXX": "false", "TORCHINDUCTOR_CACHE_DIR": str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", FALLBACK], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0 and "fallback ok" in result.stdout, result.stderr[-3000:]
