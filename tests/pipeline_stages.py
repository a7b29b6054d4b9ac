"""Ranks of a spawned pipeline-parallel optimizer test (tests/test_pipeline_parallel.py).

A module of its own so that the spawned ranks import only torch and titan_muon, not
torchtitan (the test module imports it for its launches).
"""

import torch
import torch.distributed as dist
from common import grads_for, make_params
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from titan_muon import Muon

# Four ranks, two stages of two FSDP ranks each, as torchtitan lays out PP 2 x FSDP 2. The
# stages hold different matrices (uneven row counts, one Muon matrix fewer): were their
# optimizers to share a process group, the plans would differ and the build would fail, or
# the all-to-alls would mix or hang. (With dp = 1 the parameters are plain tensors and Muon
# has no group at all: test_pipeline_run_equals_one_process.)
STAGE_SHAPES = [
    {"a": (30, 64), "b": (63, 64), "emb": (50, 16)},
    {"c": (3, 256), "d": (64, 30), "e": (48, 48), "bias": (17,)},
]
MUON = {"a", "b", "c", "d", "e"}
SETTINGS = dict(lr=0.02, weight_decay=0.1, momentum=0.9, exchange_memory_mb=0.01)
STEPS, DP = 3, 2


def _stage():
    """This rank's mesh, stage, whole parameters, FSDP-sharded parameters and Muon/AdamW groups."""
    mesh = init_device_mesh("cpu", (2, DP), mesh_dim_names=("pp", "dp"))
    stage = mesh.get_coordinate()[0]
    full = make_params(stage, STAGE_SHAPES[stage])
    module = nn.Module()
    for name, tensor in full.items():
        module.register_parameter(name, nn.Parameter(distribute_tensor(tensor, mesh["dp"], [Shard(0)])))
    named = dict(module.named_parameters())
    groups = [
        {"params": [(n, p) for n, p in named.items() if n in MUON]},
        {"params": [(n, p) for n, p in named.items() if n not in MUON], "use_muon": False},
    ]
    return mesh, stage, full, named, groups


def stage_run(rank, world, with_pipeline_group=False):
    """PP 2 x FSDP 2, STEPS steps; ``with_pipeline_group``: the stages agree over the pipeline
    (as titan_muon's torchtitan containers set it up), and each step still streams, reserved."""
    mesh, stage, full, named, groups = _stage()
    optimizer = Muon(groups, **SETTINGS, **({"pipeline_group": mesh["pp"].get_group()} if with_pipeline_group else {}))
    for step in range(STEPS):
        for name, grad in grads_for(step, full).items():
            named[name].grad = distribute_tensor(grad, mesh["dp"], [Shard(0)])
        optimizer.step()
    return {
        "stage": stage,
        "exchange_ranks": sorted(dist.get_process_group_ranks(optimizer.transport.group)),
        "commit_plan": optimizer.commit_plan,
        "params": {n: p.full_tensor() for n, p in named.items()},
    }


def stage_skip_run(rank, world, policy, join_later=False):
    """PP 2 x FSDP 2; at step 1 only stage 1 sees a NaN gradient. With the pipeline group
    passed, both stages skip (or both raise): a stage must not step while another skips.
    ``join_later``: the group is given after construction (``set_pipeline_group``), as
    torchtitan 0.3.0's container does."""
    mesh, stage, full, named, groups = _stage()
    if join_later:
        optimizer = Muon(groups, nonfinite_grads=policy, **SETTINGS)
        optimizer.set_pipeline_group(mesh["pp"].get_group())
    else:
        optimizer = Muon(groups, nonfinite_grads=policy, pipeline_group=mesh["pp"].get_group(), **SETTINGS)
    outcome, before = "stepped", None
    for step in range(2):
        grads = grads_for(step, full)
        if step == 1 and stage == 1:
            grads["c"][0, 0] = float("nan")
        for name, grad in grads.items():
            named[name].grad = distribute_tensor(grad, mesh["dp"], [Shard(0)])
        before = {n: p.full_tensor() for n, p in named.items()}
        try:
            optimizer.step()
        except FloatingPointError as error:
            outcome = str(error)
    after = {n: p.full_tensor() for n, p in named.items()}
    unchanged = all(torch.equal(before[n], after[n]) for n in before)
    return {"stage": stage, "outcome": outcome, "unchanged": unchanged, "skipped": optimizer.skipped_steps}


class _ReservationFailsOnce:
    """`torch` as titan_muon.exchange.reservation sees it, except that its first `torch.empty`
    (the step's reservation) raises, as an out-of-memory error would."""

    def __init__(self):
        self.failed = False

    def __getattr__(self, name):
        if name != "empty" or self.failed:
            return getattr(torch, name)

        def empty(*args, **kwargs):
            self.failed = True
            raise MemoryError("injected failure")

        return empty


def stage_reservation_failure_run(rank, world, failing_rank, nan_stage=None):
    """PP 2 x FSDP 2 with the pipeline group, streaming (commit="auto"), reserved anew each step
    (keep_reservation=False, as on a GPU); at step 1 `failing_rank` cannot reserve, and with
    `nan_stage` that stage's "c" or "a" has a NaN gradient (nonfinite_grads="skip")."""
    from titan_muon.exchange import reservation

    mesh, stage, full, named, groups = _stage()
    optimizer = Muon(groups, pipeline_group=mesh["pp"].get_group(), keep_reservation=False, nonfinite_grads="skip", **SETTINGS)
    outcome = "stepped"
    for step in range(2):
        grads = grads_for(step, full)
        if step == 1 and stage == nan_stage:
            grads["c" if stage == 1 else "a"][0, 0] = float("nan")
        for name, grad in grads.items():
            named[name].grad = distribute_tensor(grad, mesh["dp"], [Shard(0)])
        before = ({n: p.to_local().clone() for n, p in named.items()},
                  {(n, k): v.to_local().clone() for n, p in named.items() for k, v in optimizer.state[p].items() if v.ndim > 0})  # fmt: skip
        original = reservation.torch
        if step == 1 and rank == failing_rank:
            reservation.torch = _ReservationFailsOnce()
        try:
            optimizer.step()
        except RuntimeError as error:
            outcome = str(error)
        finally:
            reservation.torch = original
    after = ({n: p.to_local().clone() for n, p in named.items()},
             {(n, k): v.to_local().clone() for n, p in named.items() for k, v in optimizer.state[p].items() if v.ndim > 0})  # fmt: skip
    unchanged = before[0].keys() == after[0].keys() and all(torch.equal(before[0][n], after[0][n]) for n in before[0]) and \
        before[1].keys() == after[1].keys() and all(torch.equal(before[1][k], after[1][k]) for k in before[1])  # fmt: skip
    return {"stage": stage, "outcome": outcome, "unchanged": unchanged, "commit_plan": optimizer.commit_plan,
            "skipped": optimizer.skipped_steps}


# torchtitan's pipeline split makes stages that hold no Muon matrix: generate_llm_fqn_per_model_part(4, 4)
# gives a last stage of ["norm", "output"], both AdamW in titan_muon's param groups.
ADAMW_ONLY_SHAPES = {"norm": (16,), "output": (50, 16)}


def _local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def no_muon_stage_run(rank, world, policy, stages, bad):
    """`stages` pipeline stages (1: plain FSDP over every rank) of world // stages FSDP ranks; the last
    stage holds AdamW parameters only. At step 1 one entry of "output"'s gradient is `bad` (NaN or
    Inf) in the last row, so on the stage's last FSDP rank only — what an Inf looks like after
    torchtitan's clipping on the other ranks too: their shards are finite (zero). Every rank of every
    stage must skip, or raise, with parameters and optimizer state unchanged."""
    dp = world // stages
    if stages == 1:
        mesh = init_device_mesh("cpu", (dp,), mesh_dim_names=("dp",))
        stage, dp_mesh, pipeline = 0, mesh, {}
    else:
        mesh = init_device_mesh("cpu", (stages, dp), mesh_dim_names=("pp", "dp"))
        stage, dp_mesh, pipeline = mesh.get_coordinate()[0], mesh["dp"], {"pipeline_group": mesh["pp"].get_group()}
    shapes = ADAMW_ONLY_SHAPES if stage == stages - 1 else STAGE_SHAPES[0]
    full = make_params(stage, shapes)
    module = nn.Module()
    for name, tensor in full.items():
        module.register_parameter(name, nn.Parameter(distribute_tensor(tensor, dp_mesh, [Shard(0)])))
    named = dict(module.named_parameters())
    groups = [g for g in ({"params": [(n, p) for n, p in named.items() if n in MUON]},
                          {"params": [(n, p) for n, p in named.items() if n not in MUON], "use_muon": False}) if g["params"]]  # fmt: skip
    optimizer = Muon(groups, nonfinite_grads=policy, **pipeline, **SETTINGS)
    outcome = "stepped"
    for step in range(3):
        grads = grads_for(step, full)
        if step == 1 and stage == stages - 1:
            grads["output"][-1, 0] = float(bad)
        for name, grad in grads.items():
            named[name].grad = distribute_tensor(grad, dp_mesh, [Shard(0)])
        if step == 1:
            before = ({n: p.to_local().clone() for n, p in named.items()},
                      {(n, k): _local(v).clone() for n, p in named.items() for k, v in optimizer.state[p].items()})  # fmt: skip
        try:
            optimizer.step()
        except FloatingPointError as error:
            outcome = str(error)
        if step == 1:
            after = ({n: p.to_local().clone() for n, p in named.items()},
                     {(n, k): _local(v).clone() for n, p in named.items() for k, v in optimizer.state[p].items()})  # fmt: skip
    unchanged = before[0].keys() == after[0].keys() and before[1].keys() == after[1].keys() and all(
        torch.equal(before[i][k], after[i][k]) for i in (0, 1) for k in before[i])  # fmt: skip
    return {"stage": stage, "outcome": outcome, "unchanged": unchanged, "skipped": optimizer.skipped_steps,
            "agreement_ranks": sorted(dist.get_process_group_ranks(optimizer.transport.group))}  # fmt: skip
