"""Momentum held by the owners (overlap=True, demo=True) across what changes an optimizer's
plan or hooks after construction: add_param_group after steps, load_state_dict, frozen
parameters, gradients present on some ranks only.

Every run goes through tests/distributed.py (spawned gloo ranks, a hard timeout).
"""

import pytest
import torch
from common import assert_within, grads_for, make_params
from distributed import run_distributed
from reference import ReferenceMuonAdamW
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard, distribute_tensor

from titan_muon import Muon

pytestmark = pytest.mark.timeout(600)
RUN_TIMEOUT = 240  # seconds per distributed run; a run takes a few seconds on an idle 2-core machine

# Uneven rows on 2 ranks (63, 3 rows), wide and tall, plus AdamW tensors.
SHAPES = {"a": (30, 64), "b": (63, 64), "c": (3, 256), "d": (64, 30), "e": (48, 48), "emb": (50, 16), "bias": (17,)}
FIRST_MUON, LATER_MUON = ("a", "b", "c"), ("d", "e")  # "d", "e" join in a param group added after steps
ADAMW = ("emb", "bias")
SETTINGS = dict(lr=0.02, weight_decay=0.1, momentum=0.9, adjust_lr_fn="match_rms_adamw", exchange_memory_mb=0.01)
STEPS_BEFORE, STEPS_AFTER = 2, 2


def _sharded_module(mesh, names=tuple(SHAPES)):
    module = nn.Module()
    for name, full in make_params(0, SHAPES).items():
        if name in names:
            module.register_parameter(name, nn.Parameter(distribute_tensor(full, mesh, [Shard(0)], src_data_rank=None)))
    return module


def _all_groups(named: dict) -> list[dict]:
    """Every matrix in one Muon group from the start, the rest in AdamW (no group added later)."""
    return [
        {"params": [(n, named[n]) for n in (*FIRST_MUON, *LATER_MUON)]},
        {"params": [(n, named[n]) for n in ADAMW], "use_muon": False},
    ]


def _backward(module, step, mesh):
    """A backward whose gradients are the one-process run's (grads_for): loss = Σ <p, g>, so
    each parameter's post-accumulate-grad hook fires as under FSDP2."""
    _local_backward(module, step, mesh)


def _local_backward(module, step, mesh, left_out=()):
    """Σ <p, g> on each rank's own rows (to_local: no collective, so ranks may differ), leaving
    the parameters in `left_out` without a gradient on this rank."""
    full = grads_for(step, {n: torch.empty(SHAPES[n]) for n in SHAPES})
    terms = [(p.to_local() * distribute_tensor(full[n], mesh, [Shard(0)], src_data_rank=None).to_local()).sum()
             for n, p in module.named_parameters() if n not in left_out]  # fmt: skip
    sum(terms).backward()


# ------------------------------------------------ add_param_group after steps


def _add_group_after_steps(rank, world, overlap):
    mesh = init_device_mesh("cpu", (world,))
    module = _sharded_module(mesh)
    named = dict(module.named_parameters())
    groups = [
        {"params": [(n, named[n]) for n in FIRST_MUON]},
        {"params": [(n, named[n]) for n in ADAMW], "use_muon": False},
    ]
    opt = Muon(groups, overlap=overlap, **SETTINGS)
    for step in range(STEPS_BEFORE + STEPS_AFTER):
        if step == STEPS_BEFORE:  # re-plans: the owners and rounds of "a", "b", "c" change
            opt.add_param_group({"params": [(n, named[n]) for n in LATER_MUON]})
        full = grads_for(step, {n: torch.empty(SHAPES[n]) for n in SHAPES})
        for name, p in named.items():
            if step >= STEPS_BEFORE or name not in LATER_MUON:
                p.grad = distribute_tensor(full[name], mesh, [Shard(0)], src_data_rank=None)
        opt.step()
        opt.zero_grad()
    return {n: p.full_tensor() for n, p in named.items()}


def _reference_add_group_after_steps():
    params = make_params(0, SHAPES)
    ref = ReferenceMuonAdamW(lr=SETTINGS["lr"], weight_decay=SETTINGS["weight_decay"], momentum=SETTINGS["momentum"],
                             adjust_lr_fn=SETTINGS["adjust_lr_fn"])  # fmt: skip
    for step in range(STEPS_BEFORE + STEPS_AFTER):
        stepped = {n: p for n, p in params.items() if step >= STEPS_BEFORE or n not in LATER_MUON}
        full = grads_for(step, {n: torch.empty(SHAPES[n]) for n in SHAPES})
        ref.step(stepped, {n: full[n] for n in stepped}, {n: n not in ADAMW for n in stepped})
    return params


@pytest.mark.parametrize("overlap", [False, True])
def test_add_param_group_after_steps_keeps_each_matrix_momentum(overlap):
    """Adding a group re-plans: owner-held momentum (overlap=True) used to stay keyed by the old
    unit indices and fed other matrices' momentum to Newton-Schulz (1.5e-2 off the reference)."""
    expected = _reference_add_group_after_steps()
    for rank, params in enumerate(run_distributed(_add_group_after_steps, 2, overlap, timeout=RUN_TIMEOUT)):
        for name, tensor in expected.items():
            # The reference's math in fp32, term by term; Muon fuses NS's polynomial and runs it
            # batched by shape on the owner. Each of 4 updates (<= lr·0.2·√64·1.2 ≈ 0.04) is
            # rounded in fp32 (~2^-24 relative) and moved by NS's gain on these full-rank random
            # inputs (<= ~30, docs/reliability.md): ~1e-6 of O(4) weights. AdamW is elementwise,
            # the same up to its bias-correction order. A momentum handed to the wrong matrix
            # moves a weight by ~1e-2; 1e-5 separates the two.
            assert_within(params[name], tensor, 1e-5, f"rank {rank} overlap={overlap} {name}")


# DeMo: 2 replicas x 2 shards, compared with the same run holding every group from the start
# (the later group's parameters without gradients until then: no update, no state change).

DEMO_SETTINGS = dict(lr=0.02, weight_decay=0.01, momentum=0.99, nesterov=False, ns_algorithm="standard",
                     exchange_memory_mb=0.01, demo_chunk=16, demo_topk=4, demo_alpha=0.2)  # fmt: skip


def _demo_add_group_after_steps(rank, world, add_later):
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    replica = mesh.get_coordinate()[0]
    module = nn.Module()
    for name, full in make_params(0, SHAPES).items():
        module.register_parameter(name, nn.Parameter(full.clone()))
    fully_shard(module, mesh=mesh["shard"])
    named = dict(module.named_parameters())
    first = [(n, named[n]) for n in FIRST_MUON] + ([] if add_later else [(n, named[n]) for n in LATER_MUON])
    groups = [{"params": first}, {"params": [(n, named[n]) for n in ADAMW], "use_muon": False}]
    opt = Muon(groups, demo=True, replicate_group=mesh.get_group("replicate"), **DEMO_SETTINGS)
    for step in range(STEPS_BEFORE + STEPS_AFTER):
        if step == STEPS_BEFORE and add_later:
            opt.add_param_group({"params": [(n, named[n]) for n in LATER_MUON]})
        full = grads_for(10 * step + replica, {n: torch.empty(SHAPES[n]) for n in SHAPES})  # every replica its own
        for name, p in named.items():
            if step >= STEPS_BEFORE or name not in LATER_MUON:
                p.grad = distribute_tensor(full[name], p.device_mesh, p.placements, src_data_rank=None)
        opt.step()
        opt.zero_grad()
    return {n: p.full_tensor() for n, p in named.items()}


def test_demo_add_param_group_after_steps_keeps_each_matrix_momentum():
    """DeMo's owner blocks were keyed by unit index too (8.8e-3 off after adding a group)."""
    from_start = run_distributed(_demo_add_group_after_steps, 4, False, timeout=RUN_TIMEOUT)
    added = run_distributed(_demo_add_group_after_steps, 4, True, timeout=RUN_TIMEOUT)
    for rank, (a, b) in enumerate(zip(from_start, added)):
        for name, tensor in a.items():
            # Both runs do the same fp32 math on the same gradients; before the group is added
            # the plans differ, so NS may batch "a", "b", "c" with other shapes' matrices and
            # GEMM kernels may sum in another order: a few fp32 ulps of each update (<= 0.04).
            # A momentum handed to another matrix moves a weight by ~1e-2.
            assert_within(b[name], tensor, 1e-5, f"rank {rank} {name}")


# ------------------------------------------------ load_state_dict with overlap


def _backward_all_to_alls(module, step, mesh) -> int:
    """How many all-to-alls one backward starts (overlap sends each completed round)."""
    import torch.distributed as dist

    original, calls = dist.all_to_all_single, []

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    dist.all_to_all_single = counting
    try:
        _backward(module, step, mesh)
    finally:
        dist.all_to_all_single = original
    return len(calls)


def _hooks_after_loads(rank, world, loads):
    mesh = init_device_mesh("cpu", (world,))
    module = _sharded_module(mesh)
    named = dict(module.named_parameters())
    groups = _all_groups(named)
    opt = Muon(groups, overlap=True, **SETTINGS)
    sends = [_backward_all_to_alls(module, 0, mesh)]
    opt.step()
    opt.zero_grad()
    for load in range(loads):  # every resume
        opt.load_state_dict(opt.state_dict())
        sends.append(_backward_all_to_alls(module, 1 + load, mesh))
        opt.step()
        opt.zero_grad()
    hooks = {n: len(named[n]._post_accumulate_grad_hooks or {}) for n in (*FIRST_MUON, *LATER_MUON)}
    return {"sends": sends, "hooks": hooks, "params": {n: p.full_tensor() for n, p in named.items()}}


def test_load_state_dict_leaves_one_gradient_hook_per_parameter():
    """Every load_state_dict re-planned without removing the previous hooks: after 1, 2, 3
    loads each parameter had 2, 3, 4 hooks and backward sent every round 2x, 3x, 4x."""
    for rank, result in enumerate(run_distributed(_hooks_after_loads, 2, 3, timeout=RUN_TIMEOUT)):
        assert set(result["hooks"].values()) == {1}, (rank, result["hooks"])
        assert result["sends"][0] > 0, "no round was sent during backward"
        assert result["sends"] == [result["sends"][0]] * 4, (rank, result["sends"])


# ------------------------------------------------ a frozen Muon parameter


def _frozen_parameter(rank, world, overlap):
    mesh = init_device_mesh("cpu", (world,))
    module = _sharded_module(mesh)
    named = dict(module.named_parameters())
    named["b"].requires_grad_(False)  # frozen: never gets a gradient
    groups = _all_groups(named)
    opt = Muon(groups, overlap=overlap, **SETTINGS)
    sent_in_backward = []
    for step in range(3):
        if step == 2:  # unfrozen: its momentum starts from zero, as overlap=False keeps it
            named["b"].requires_grad_(True)
        _backward(module, step, mesh)
        opt.step()
        opt.zero_grad()
        sent_in_backward.append(opt.last_step_metrics.get("muon/rounds_sent_in_backward", 0.0))
    return {"params": {n: p.full_tensor() for n, p in named.items()}, "sent_in_backward": sent_in_backward}


def test_frozen_muon_parameter_with_overlap_equals_no_overlap():
    """overlap=True used to fail at construction (a gradient hook on a frozen parameter). A
    frozen parameter gets no gradient: it keeps its weights and momentum, like overlap=False."""
    plain = run_distributed(_frozen_parameter, 2, False, timeout=RUN_TIMEOUT)
    overlapped = run_distributed(_frozen_parameter, 2, True, timeout=RUN_TIMEOUT)
    initial = make_params(0, SHAPES)
    for rank, (a, b) in enumerate(zip(plain, overlapped)):
        for name, tensor in a["params"].items():
            # No gradient clipping: both modes build fp32 momentum from the same fp32 gradients
            # and orthogonalize the same matrices (test_overlap_equals_no_overlap_exactly_without_clipping).
            assert torch.equal(b["params"][name], tensor), (rank, name)
        assert b["sent_in_backward"][1] > 0, "rounds without the frozen parameter should still leave during backward"
    # while frozen, "b" did not move (the third step moved it once, from its initial weights)
    assert not torch.equal(plain[0]["params"]["b"], initial["b"])


# ------------------------------------------------ a gradient present on some ranks only


def _gradient_on_some_ranks(rank, world, overlap):
    """Step 0 normal; in step 1 rank 0 leaves "b" out of its loss (no gradient there only); then
    a normal step again. Returns the error and whether step 1 changed anything."""
    mesh = init_device_mesh("cpu", (world,))
    module = _sharded_module(mesh)
    named = dict(module.named_parameters())
    groups = _all_groups(named)
    opt = Muon(groups, overlap=overlap, **SETTINGS)
    errors = []
    for step in range(3):
        _local_backward(module, step, mesh, left_out={"b"} if step == 1 and rank == 0 else set())
        before = {n: p.full_tensor() for n, p in named.items()}
        try:
            opt.step()
        except RuntimeError as error:
            errors.append(str(error))
            unchanged = all(torch.equal(before[n], p.full_tensor()) for n, p in named.items())
        opt.zero_grad()
    return {"errors": errors, "unchanged": unchanged, "params": {n: p.full_tensor() for n, p in named.items()}}


def test_gradient_on_some_ranks_only_raises_on_every_rank_with_overlap():
    """With overlap=True the rank with the gradient had sent its round during backward and
    blocked in that transfer while the other rank raised (on NCCL until the watchdog). Now every
    rank raises the same error naming the parameter, nothing changes, and the next step (the
    transfers settled) equals overlap=False's."""
    plain = run_distributed(_gradient_on_some_ranks, 2, False, timeout=RUN_TIMEOUT)
    overlapped = run_distributed(_gradient_on_some_ranks, 2, True, timeout=120)
    for rank, (a, b) in enumerate(zip(plain, overlapped)):
        assert len(b["errors"]) == 1 and "gradients of ['b'] exist on some ranks but not on others" in b["errors"][0], (rank, b["errors"])
        assert b["unchanged"], rank
        for name, tensor in a["params"].items():
            # no clipping: both modes do the same fp32 math (test_overlap_equals_no_overlap_exactly_without_clipping)
            assert torch.equal(b["params"][name], tensor), (rank, name)
