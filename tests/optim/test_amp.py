"""torch's AMP protocol: torch.amp.GradScaler hands the optimizer its loss scale and verdict
(``_step_supports_amp_scaling``), and a caller can hand over a non-finite flag it already has."""

import pytest
import torch
from torch import nn

from moga.kernels import FusedCalls
from moga.optim import MOGA, ScaledAdamW
from tests.fake_cuda import trace
from tests.optim.mup_reference import TinyLM, mup_adam_groups


@pytest.mark.parametrize("clip", [False, True])
def test_grad_scaler_fp16_training_equals_torch_adamw_under_the_same_scaler(clip):
    # fp16 autocast with a loss scale that overflows at first: steps are skipped and the scale backs off,
    # then grows. ScaledAdamW must skip the same steps and take AdamW's (muP) steps; with clipping the
    # caller unscales first (GradScaler then passes no scale, only its verdict).
    torch.manual_seed(0)
    ours, ref = TinyLM(), TinyLM()
    ref.load_state_dict(ours.state_dict())
    opt = ScaledAdamW(ours, lr=0.05, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(mup_adam_groups(ref, 0.05, 0.1), foreach=False)
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0**18, growth_interval=2) for _ in range(2)]
    gen = torch.Generator().manual_seed(1)
    scales = [[], []]
    for _ in range(12):
        tokens = torch.randint(0, 20, (4, 7), generator=gen)
        for k, (model, o, scaler) in enumerate(((ours, opt, scalers[0]), (ref, ref_opt, scalers[1]))):
            o.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                logits = model(tokens[:, :-1])
            loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
            scaler.scale(loss).backward()
            if clip:
                scaler.unscale_(o)
                nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(o)
            scaler.update()
            scales[k].append(scaler.get_scale())
    assert scales[0] == scales[1], scales
    skipped = sum(1 for a, b in zip(scales[0], [2.0**18] + scales[0]) if a < b)
    assert 0 < skipped < 12 and opt.skipped_steps == skipped
    for (name, a), b in zip(ours.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


def test_a_supplied_flag_replaces_the_gradient_check():
    def make():
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
        return net, MOGA(net, kernel="cpp", vectors="sign")

    def grads(net, seed):
        gen = torch.Generator().manual_seed(seed)
        net.zero_grad()
        net(torch.randn(5, 6, generator=gen)).square().mean().backward()

    (a, opt_a), (b, opt_b) = make(), make()
    for seed in range(3):
        grads(a, seed)
        grads(b, seed)
        opt_a.step()
        with FusedCalls() as calls:
            opt_b.step(found_inf=torch.zeros(()))
        assert not any("found_nonfinite" in name for name, _ in calls.ops)  # no second pass over the gradients
        assert calls.stepped == 2
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
    grads(b, 9)
    before = [p.detach().clone() for p in b.parameters()]
    state = {k: v.clone() for k, v in opt_b.state[b[0].weight].items()}
    opt_b.step(found_inf=torch.ones(()))  # finite gradients, but the caller says skip
    assert all(torch.equal(p, q) for p, q in zip(b.parameters(), before))
    assert all(torch.equal(opt_b.state[b[0].weight][k], v) for k, v in state.items())
    assert opt_b.skipped_steps == 1
    with pytest.raises(TypeError, match="found_inf"):
        opt_b.step(found_inf=1.0)


def test_raise_policy_raises_on_a_set_flag():
    w = nn.Parameter(torch.randn(3, 4))
    opt = MOGA([w], geometry="row(p=2)", nonfinite="raise")
    w.grad = torch.ones(3, 4)
    before = w.detach().clone()
    with pytest.raises(FloatingPointError, match="found_inf"):
        opt.step(found_inf=torch.ones(()))
    assert torch.equal(w, before)


def _mlp(width: int, layers: int, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


def _backward(net: nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    net.zero_grad()
    net(torch.randn(5, net[0].in_features, generator=gen)).square().mean().backward()


FLAGS = {"bool": lambda v: torch.tensor(bool(v)), "float32": lambda v: torch.tensor(float(v)),
         "float32[1]": lambda v: torch.full((1,), float(v))}


@pytest.mark.parametrize("flag", list(FLAGS))
@pytest.mark.parametrize("kernel", ["cpp", "torch"])
def test_a_clear_flag_is_the_unchecked_step_and_a_set_flag_changes_nothing_bitwise(kernel, flag):
    # row(2) matrices (moga's kernel, or the plain path) and Adam on the biases, from the same weights
    (a, b) = _mlp(8, 3), _mlp(8, 3)
    unchecked = MOGA(a, lr=0.1, weight_decay=0.1, kernel=kernel, nonfinite="ignore")
    flagged = MOGA(b, lr=0.1, weight_decay=0.1, kernel=kernel)
    for seed in range(3):
        _backward(a, seed)
        _backward(b, seed)
        unchecked.step()
        flagged.step(found_inf=FLAGS[flag](0))
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
        assert all(torch.equal(unchecked.state[p][k], v) for k, v in flagged.state[q].items())
    _backward(b, 9)
    weights = [p.detach().clone() for p in b.parameters()]
    state = [{k: v.clone() for k, v in flagged.state[p].items()} for p in b.parameters()]
    flagged.step(found_inf=FLAGS[flag](1))  # finite gradients, but the caller says skip
    for p, w, s in zip(b.parameters(), weights, state):
        assert torch.equal(p, w)
        assert flagged.state[p].keys() == s.keys() and all(torch.equal(flagged.state[p][k], v) for k, v in s.items())
    assert flagged.skipped_steps == 1


def _ops(opt, **kwargs) -> int:
    opt.step(**kwargs)  # state made; then one steady-state step, counted
    return trace(lambda: opt.step(**kwargs)).count


@pytest.mark.parametrize("flag,matrices_only,most", [("bool", True, 1), ("float32", True, 2), ("float32", False, 5)])
def test_a_supplied_flag_adds_a_few_ops_per_step_whatever_the_number_of_parameters(flag, matrices_only, most):
    # The flag is the caller's verdict: the step should do what the unchecked step does plus a handful of
    # 0-d ops (the flag as a bool, the skip counter; with Adam groups the step count and fused AdamW's flag),
    # never a pass or an op per gradient.
    extra = []
    for layers in (4, 16):
        nets = [_mlp(8, layers) for _ in range(2)]
        for net in nets:
            if matrices_only:
                for layer in net:
                    layer.bias = None
            _backward(net, 0)
        unchecked = MOGA(nets[0], lr=0.1, kernel="cpp", nonfinite="ignore")
        flagged = MOGA(nets[1], lr=0.1, kernel="cpp")
        extra.append(_ops(flagged, found_inf=FLAGS[flag](0)) - _ops(unchecked))
    assert extra[0] == extra[1] and 0 <= extra[0] <= most, extra
