"""torch's own optimizer test inputs for ``torch.optim.Muon`` (its ``optim_db`` entry), run on
titan_muon.Muon: every configuration torch tests gives torch's momentum bit for bit and its
weights to bf16 Newton–Schulz rounding, and every bad input torch refuses is refused here too
(some earlier: a complex parameter at construction rather than at the first step).
"""

import warnings

import pytest
import torch
from torch import nn

from common import grads_for, make_params
from titan_muon import Muon

optim_db = pytest.importorskip("torch.testing._internal.common_optimizers").optim_db
MUON_INFO = next(info for info in optim_db if info.optim_cls is torch.optim.Muon)
CONFIGS = [({}, "defaults")] + [(i.kwargs, i.desc) for i in MUON_INFO.optim_inputs_func(device="cpu")]
SHAPES = {"a": (30, 64), "b": (63, 64), "c": (3, 256), "d": (64, 30), "e": (48, 48)}
STEPS = 3


@pytest.mark.parametrize("kwargs", [c for c, _ in CONFIGS], ids=[d for _, d in CONFIGS])
def test_torch_optim_muon_configurations(kwargs):
    """torch.optim.Muon runs Keller's iteration in bf16 from fp32 momentum; so does titan_muon
    with ns_dtype="bf16", ns_algorithm="standard". Momentum takes the same two lerps: bit for
    bit. Weights: the same bf16 kernels, with the update scaled in another order (lr·(s·O) vs
    (lr·s)·O, one fp32 rounding of an update ~lr, plus the decay's): within 1e-5 relative to the
    largest weight after 3 steps."""
    params = make_params(shapes=SHAPES)
    mine = {n: nn.Parameter(p.clone()) for n, p in params.items()}
    theirs = {n: nn.Parameter(p.clone()) for n, p in params.items()}
    ours = Muon(list(mine.values()), ns_dtype="bf16", ns_algorithm="standard", **kwargs)
    reference = torch.optim.Muon(list(theirs.values()), **kwargs)
    for s in range(STEPS):
        for n, g in grads_for(s, params).items():
            mine[n].grad, theirs[n].grad = g.clone(), g.clone()
        ours.step()
        reference.step()
    for n in params:
        assert torch.equal(ours.state[mine[n]]["momentum_buffer"], reference.state[theirs[n]]["momentum_buffer"]), n
        scale = params[n].abs().max()
        assert (mine[n] - theirs[n]).abs().max() <= 1e-5 * scale, n


ERRORS = MUON_INFO.optim_error_inputs_func(device="cpu", dtype=torch.float32)


@pytest.mark.parametrize("case", ERRORS, ids=[e.error_regex[:40] for e in ERRORS])
def test_torch_optim_muon_error_inputs_are_refused(case):
    """Each input torch refuses, refused here (TypeError/ValueError/RuntimeError, or torch's own
    warning for duplicate parameters): none is silently accepted."""
    inputs = case.optimizer_error_input
    if case.error_type is UserWarning:
        with pytest.warns(UserWarning, match=case.error_regex):
            Muon(inputs.params, **inputs.kwargs)
        return
    with pytest.raises((TypeError, ValueError, RuntimeError)):
        opt = Muon(inputs.params, **inputs.kwargs)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for p in (q for g in opt.param_groups for q in g["params"]):
                p.grad = torch.ones_like(p)
            opt.step()
