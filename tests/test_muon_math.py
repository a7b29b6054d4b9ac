"""Muon's one-page math (titan_muon.muon_math) against the independent reference, and every path
of the optimizer against the one-page math: the default streaming commit, the atomic commit, the
compiled element-wise passes, Split row blocks, expert stacks, owner-held momentum (overlap) and
each adjust_lr_fn and coefficient set.

Tolerances: the optimizer and the page run the same fp32 formulas in another order (NS's
polynomial fused into addmm, momentum and the update in one pass, lr·s folded into the last
product or the commit's lerp). Each of `STEPS` updates of size lr·s (s <= 1.4 here) is then off
by a few fp32 roundings, moved by NS's small gain on full-rank random inputs (~20, as in
test_optimizer_single.test_matches_fp32_reference): 20 · 2^-23 · STEPS · lr·s ≈ 3e-7 of O(1)
weights; 1e-6 of the largest weight leaves room and fails for any real difference (one missed
momentum step moves the weights by ~1e-3).
"""

import pytest
import torch
from common import FP32_ULP, SHAPES, grads_for, make_params, max_rel, run_titan
from reference import ReferenceMuonAdamW, reference_ns

from titan_muon import muon_math

STEPS = 3
SETTINGS = dict(lr=0.02, weight_decay=0.1, momentum=0.9)


def by_the_page(params, steps=STEPS, row_blocks=None, **settings):
    """`steps` steps of muon_math.muon_step on every parameter."""
    settings = {**SETTINGS, **settings}
    weights = {n: p.clone() for n, p in params.items()}
    buffers = {n: torch.zeros_like(p) for n, p in params.items()}
    for s in range(steps):
        for name, grad in grads_for(s, params).items():
            muon_math.muon_step(weights[name], grad, buffers[name], row_block=(row_blocks or {}).get(name), **settings)
    return weights


@pytest.mark.parametrize("shape", [(30, 64), (64, 30), (48, 48), (3, 256)])
def test_newton_schulz_is_the_reference_iteration(shape):
    """Keller's quintic on the short side from X/‖X‖_F: the same fp32 operations as
    tests/reference.py in the same order, so equal to a few roundings of O(1) entries."""
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    assert (muon_math.newton_schulz(x) - reference_ns(x)).abs().max() <= 16 * FP32_ULP


def test_polar_express_pushes_singular_values_closer_to_one_than_keller():
    """On this 64 x 256 Gaussian matrix (measured): Polar Express's 5 tuples leave singular values
    in [0.859, 1.141], Keller's quintic in [0.682, 1.128]. A wrong tuple order or coefficient set
    leaves them far from either (Keller's reversed: [0.50, 0.53])."""
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(2))
    polar = torch.linalg.svdvals(muon_math.newton_schulz(x, coefficients="polar_express"))
    keller = torch.linalg.svdvals(muon_math.newton_schulz(x))
    assert 0.85 <= polar.min() and polar.max() <= 1.15 and keller.min() < 0.7


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("adjust_lr_fn", [None, "match_rms_adamw", "spectral_unclamped"])
def test_the_page_matches_the_independent_reference(nesterov, adjust_lr_fn):
    params = make_params()
    ref = ReferenceMuonAdamW(nesterov=nesterov, adjust_lr_fn=adjust_lr_fn, **SETTINGS)
    expected = {n: p.clone() for n, p in params.items()}
    for s in range(STEPS):
        ref.step(expected, grads_for(s, params), dict.fromkeys(params, True))
    assert max_rel(by_the_page(params, nesterov=nesterov, adjust_lr_fn=adjust_lr_fn), expected) <= 1e-6


PATHS = {
    "streaming": dict(commit="streaming"),
    "atomic": dict(commit="atomic"),
    "compiled": dict(compile_elementwise=True),
    "polar_express": dict(ns_coefficients="polar_express"),
    "no_nesterov": dict(nesterov=False),
    "match_rms_adamw": dict(adjust_lr_fn="match_rms_adamw"),
}


@pytest.mark.parametrize("path", PATHS)
def test_every_single_process_path_is_the_page(path):
    settings = PATHS[path]
    page_settings = {k: v for k, v in settings.items() if k in ("nesterov", "adjust_lr_fn")}
    if "ns_coefficients" in settings:
        page_settings["ns_coefficients"] = settings["ns_coefficients"]
    params = make_params()
    ours, _ = run_titan(params, STEPS, set(SHAPES), ns_algorithm="standard", **SETTINGS, **settings)
    assert max_rel(ours, by_the_page(params, **page_settings)) <= 1e-6


def test_split_row_blocks_and_expert_stacks_are_the_page():
    """Split: "b" (63 rows) in blocks of 21, "e" in blocks of 16, each orthogonalized and scaled
    on its own; a 3-D stack is one matrix per expert."""
    shapes = {**SHAPES, "experts": (4, 24, 40)}
    params = make_params(shapes=shapes)
    blocks = {"b": 21, "e": 16}
    tensors = {n: torch.nn.Parameter(p.clone()) for n, p in params.items()}
    from titan_muon import Muon

    opt = Muon([{"params": list(tensors.items()), "matrix_stacks": True}], row_blocks=blocks, ns_algorithm="standard", **SETTINGS)
    for s in range(STEPS):
        for n, g in grads_for(s, params).items():
            tensors[n].grad = g
        opt.step()
    ours = {n: t.detach() for n, t in tensors.items()}
    assert max_rel(ours, by_the_page(params, row_blocks=blocks)) <= 1e-6


def _overlap_run(rank, world):
    """FSDP 2 with momentum on the owners and gradients sent during backward."""
    from common import grads_for, make_params
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from titan_muon import Muon

    mesh = init_device_mesh("cpu", (world,))
    full = make_params()
    module = nn.Module()
    for name, tensor in full.items():
        module.register_parameter(name, nn.Parameter(distribute_tensor(tensor, mesh, [Shard(0)])))
    named = dict(module.named_parameters())
    opt = Muon(list(named.items()), overlap=True, ns_algorithm="standard", exchange_memory_mb=0.01, **SETTINGS)
    for s in range(STEPS):
        grads = grads_for(s, full)
        loss = sum((p.to_local() * distribute_tensor(grads[n], mesh, [Shard(0)], src_data_rank=None).to_local()).sum()
                   for n, p in named.items())  # fmt: skip
        loss.backward()
        opt.step()
        opt.zero_grad()
    return {n: p.full_tensor() for n, p in named.items()}


def test_owner_held_momentum_is_the_page():
    """overlap=True keeps whole-matrix momentum on each matrix's owner: the same page, per matrix."""
    from distributed import run_distributed

    expected = by_the_page(make_params())
    for result in run_distributed(_overlap_run, 2, timeout=240):
        assert max_rel(result, expected) <= 1e-6
