"""Parameters, gradients and a one-process run shared by the optimizer tests, and the helpers
that compare two runs (see docs/reliability.md, "Portability")."""

import json
import os

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from titan_muon import Muon

SHAPES = {"a": (30, 64), "b": (63, 64), "c": (3, 256), "d": (64, 30), "e": (48, 48)}


def make_params(seed=0, shapes=SHAPES):
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(*s, generator=g) for n, s in shapes.items()}


def grads_for(step, params):
    g = torch.Generator().manual_seed(1000 + step)
    return {n: torch.randn(p.shape, generator=g) for n, p in params.items()}


def run_titan(params, steps, muon_names, **kwargs):
    tensors = {n: nn.Parameter(p.clone()) for n, p in params.items()}
    muon = [(n, t) for n, t in tensors.items() if n in muon_names]
    adamw = [(n, t) for n, t in tensors.items() if n not in muon_names]
    groups = [g for g in ({"params": muon, "use_muon": True}, {"params": adamw, "use_muon": False}) if g["params"]]
    opt = Muon(groups, **kwargs)
    for s in range(steps):
        for n, g in grads_for(s, params).items():
            tensors[n].grad = g
        opt.step()
    return {n: t.detach() for n, t in tensors.items()}, opt


# ---------------------------------------------------------------- comparing two runs


def max_rel(a: dict, b: dict) -> float:
    """The largest difference between two runs' tensors, each relative to its tensor's largest entry in `b`."""
    return max(((a[n] - b[n]).abs().max() / b[n].abs().max()).item() for n in a)

# Relative spacing of fp32 numbers near 1 (one ulp): the size of one rounding.
FP32_ULP = 2.0**-23


def record_margin(what: str, error: float, bound: float) -> None:
    """With TITAN_MUON_TEST_MARGINS=FILE, append (test, what, error, bound) to FILE as a JSON line."""
    path = os.environ.get("TITAN_MUON_TEST_MARGINS")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"test": os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" ", 1)[0], "what": what, "error": error, "bound": bound}) + "\n")


def assert_within(got: torch.Tensor, expected: torch.Tensor, bound: float, what: str) -> None:
    """max |got − expected| <= bound (absolute), the margin recorded (see record_margin)."""
    error = (got.double() - expected.double()).abs().max().item() if got.numel() else 0.0
    record_margin(what, error, bound)
    assert error <= bound, f"{what}: max |difference| {error:.3g} > bound {bound:.3g}"


def adamw_names(optimizer) -> list[str]:
    return [name for group in optimizer.param_groups if not group["use_muon"] for name in group["param_names"]]


def whole_gradients(model, names) -> dict[str, torch.Tensor]:
    """The gradients a step used, whole: on W ranks, FSDP's reduce-scattered shards gathered (a collective)."""
    params = dict(model.named_parameters())
    return {n: (g.full_tensor() if isinstance(g, DTensor) else g).detach().clone() for n in names if (g := params[n].grad) is not None}


# A W-rank backward sums each gradient in another order than one process. Relative to the
# tensor's largest entry that moves it by ~1e-8 in the plain models here and by ~1e-6 in the
# MuonClip ones, whose boosted attention logits (~40) carry fp32 rounding of ~40·2^-24 ≈ 2.4e-6
# into softmax. 1e-4 bounds both with room; a gradient reduced wrongly (a rank missing, a mean
# taken twice) is off by >= 30 %.
GRADIENT_RTOL = 1e-4


def feed_adamw_gradients(model, optimizer, reduced: dict[str, torch.Tensor], what: str, rtol: float = GRADIENT_RTOL) -> None:
    """Give this run's AdamW the gradients another run reduced (whole tensors), after checking
    that its own agree with them up to summation order (`rtol` of each tensor's largest entry).
    On W ranks (DTensor gradients) every rank takes its rows.

    Why: AdamW divides by sqrt(v). Where v is small next to the rounding of g (an embedding
    row whose gradient is a near-cancelling sum), a last-bit difference in g moves the update by
    a sizeable fraction of lr, so the AdamW parameters of two runs with differently rounded
    gradients differ by what rounding did, not by what the optimizer did. Fed the same
    gradients, AdamW is elementwise and layout-independent: its parameters agree to the last bit.
    """
    params = dict(model.named_parameters())
    for name in adamw_names(optimizer):
        own = params[name].grad
        if own is None:
            assert name not in reduced, f"{what}: {name} has no gradient here but had one in the other run"
            continue
        whole = own.full_tensor() if isinstance(own, DTensor) else own
        assert_within(whole, reduced[name], rtol * reduced[name].abs().max().item(), f"{what}: gradient of {name}")
        if isinstance(own, DTensor):
            own.to_local().copy_(distribute_tensor(reduced[name], own.device_mesh, own.placements, src_data_rank=None).to_local())
        else:
            own.copy_(reduced[name])
