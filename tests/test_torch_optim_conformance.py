"""torch's own optimizer test inputs for ``torch.optim.Muon`` (its ``optim_db`` entry), run on
titan_muon.Muon: every configuration torch tests gives torch's momentum bit for bit and its
weights to bf16 Newton–Schulz rounding, and every bad input torch refuses is refused here too
(some earlier: a complex parameter at construction rather than at the first step).
"""

import copy
import inspect
import warnings

import pytest
import torch
from common import grads_for, make_params
from torch import nn

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


# ------------------------------------------------ torch.optim.Muon's signature, eps included

# Newton–Schulz divides by max(‖X‖_F, eps), here as in torch: an eps far above every test matrix's
# norm (the gradients' Frobenius norms are 27 to 64 here) changes what NS gets, so the weights tell
# whether eps reached it.
TORCH_EPS = 1e4
BF16_STANDARD_NS = dict(ns_dtype="bf16", ns_algorithm="standard")  # torch.optim.Muon's kernels


def _positional_names(function):
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [p.name for p in inspect.signature(function).parameters.values() if p.kind in kinds]


def test_positional_arguments_are_torch_optim_muons():
    """A call written for torch.optim.Muon, positional arguments included, means the same here."""
    assert _positional_names(Muon.__init__) == _positional_names(torch.optim.Muon.__init__)


NS_EPS_CALLS = {
    "keyword": lambda params: Muon(params, lr=0.02, eps=TORCH_EPS, **BF16_STANDARD_NS),
    # torch.optim.Muon's order: lr, weight_decay, momentum, nesterov, ns_coefficients, eps, ns_steps, adjust_lr_fn
    "positional": lambda params: Muon(params, 0.02, 0.1, 0.95, True, (3.4445, -4.775, 2.0315), TORCH_EPS, 5, None, **BF16_STANDARD_NS),
    "param group eps": lambda params: Muon([{"params": params, "eps": TORCH_EPS}], lr=0.02, **BF16_STANDARD_NS),
    "param group ns_eps": lambda params: Muon([{"params": params, "ns_eps": TORCH_EPS}], lr=0.02, **BF16_STANDARD_NS),
}


def _weights_after_steps(build, params):
    tensors = {n: nn.Parameter(p.clone()) for n, p in params.items()}
    opt = build(list(tensors.values()))
    for s in range(STEPS):
        for n, g in grads_for(s, params).items():
            tensors[n].grad = g.clone()
        opt.step()
    return {n: t.detach() for n, t in tensors.items()}


@pytest.mark.parametrize("call", NS_EPS_CALLS)
def test_eps_is_the_newton_schulz_epsilon_as_in_torch_optim_muon(call):
    """torch.optim.Muon's eps (argument or param group key) is Newton–Schulz's epsilon; here too,
    beside its other name ns_eps. Bound as in the configurations above (same bf16 kernels, the
    update scaled in another order). TORCH_EPS moves torch's weights by over 100× that bound
    (checked against its default eps), so the comparison sees whether eps reached Newton–Schulz."""
    params = make_params(shapes=SHAPES)
    ours = _weights_after_steps(NS_EPS_CALLS[call], params)
    theirs = _weights_after_steps(lambda t: torch.optim.Muon(t, lr=0.02, eps=TORCH_EPS), params)
    default_eps = _weights_after_steps(lambda t: torch.optim.Muon(t, lr=0.02), params)
    for n in params:
        scale = params[n].abs().max()
        assert (ours[n] - theirs[n]).abs().max() <= 1e-5 * scale, n
        assert (default_eps[n] - theirs[n]).abs().max() > 100 * 1e-5 * scale, n


def test_conflicting_newton_schulz_epsilons_are_refused_naming_both():
    w = nn.Parameter(torch.randn(8, 4))
    with pytest.raises(ValueError, match=r"eps=1e-06 and ns_eps=1e-05"):
        Muon([w], eps=1e-6, ns_eps=1e-5)
    Muon([w], eps=1e-5, ns_eps=1e-5)  # the same value twice is no conflict
    with pytest.raises(ValueError, match=r"param group 0: 'eps'=1e-06 and 'ns_eps'=1e-05"):
        Muon([{"params": [w], "eps": 1e-6, "ns_eps": 1e-5}])
    with pytest.raises(ValueError, match=r"ns_eps must be a number >= 0"):
        Muon([w], eps=-1.0)


def test_eps_of_adamw_groups_stays_adamws():
    """The constructor's eps (Newton–Schulz's) never reaches AdamW groups: they take adamw_eps,
    or their own group 'eps' (torch.optim.AdamW's meaning)."""
    w, b, c = nn.Parameter(torch.randn(8, 4)), nn.Parameter(torch.randn(4)), nn.Parameter(torch.randn(4))
    opt = Muon([{"params": [w]}, {"params": [b], "use_muon": False}, {"params": [c], "use_muon": False, "eps": 1e-3}],
               eps=0.25, adamw_eps=1e-6)  # fmt: skip
    muon_group, adamw_group, own_eps_group = opt.param_groups
    assert muon_group["ns_eps"] == muon_group["eps"] == 0.25
    assert adamw_group["eps"] == 1e-6 and own_eps_group["eps"] == 1e-3


@pytest.mark.parametrize("nonfinite_grads", ["raise", "skip"])
@pytest.mark.parametrize("kwargs", [c for c, _ in CONFIGS], ids=[d for _, d in CONFIGS])
def test_deepcopy_copies_all_public_attributes(kwargs, nonfinite_grads):
    """torch's generic optimizer test: after a few steps, copy.deepcopy has the same public
    attributes; here also their values where they are flags and counters (a skipped step)."""
    params = make_params(shapes=SHAPES)
    tensors = [nn.Parameter(p.clone()) for p in params.values()]
    opt = Muon(tensors, nonfinite_grads=nonfinite_grads, **copy.deepcopy(kwargs))
    for s in range(3):
        for t, g in zip(tensors, grads_for(s, params).values()):
            t.grad = g if s < 2 or nonfinite_grads == "raise" else torch.full_like(g, float("nan"))
        opt.step()
    public = lambda obj: {k for k in obj.__dict__ if not k.startswith("_")}  # noqa: E731
    clone = copy.deepcopy(opt)
    assert public(clone) == public(opt)
    assert (clone.last_step_skipped, clone.skipped_steps) == (opt.last_step_skipped, opt.skipped_steps)
    assert opt.last_step_skipped == (nonfinite_grads == "skip")
