"""commit="streaming": each round's weights are written as its updates return.

The math is the atomic commit's, so the two must agree bit for bit (the same fused pass on the
same blocks, only earlier); the memory account drops each round's updates once written and
still bounds what is really alive; a failure after the first write is the same error on every
rank, says the parameters may be partially updated, and the optimizer refuses to step until a
checkpoint is loaded.
"""

import copy
import itertools

import pytest
import torch
from common import grads_for, make_params
from distributed import run_distributed
from live_bytes import LiveBytes
from test_memory import SHAPES as MEMORY_SHAPES
from test_memory import _model_slack, _verdict_bytes
from sharded_fixtures import SHAPES, distributed_params, muon_for, set_grads
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from titan_muon import Muon


def _run(rank, world, overrides, steps=3):
    mesh = init_device_mesh("cpu", (world,))
    module = distributed_params(mesh, [Shard(0)])
    opt = muon_for(module, **overrides)
    for step in range(steps):
        set_grads(module, step, mesh, [Shard(0)])
        opt.step()
    state = {n: {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in opt.state[p].items()}
             for n, p in module.named_parameters()}  # fmt: skip
    rounds = sum(len(e.tables) for e in opt.engines)
    return {"params": {n: p.full_tensor() for n, p in module.named_parameters()}, "state": state, "rounds": rounds,
            "peak": opt.last_step_metrics["muon/peak_transient_bytes"]}  # fmt: skip


@pytest.mark.parametrize("overrides", [{}, {"momentum_dtype": "bf16"}, {"overlap": True}], ids=["fp32", "bf16-momentum", "overlap"])
def test_streaming_equals_atomic_bit_for_bit(overrides):
    # W = 3 over uneven shapes, several rounds (exchange_memory_mb 0.01 in SETTINGS).
    atomic = run_distributed(_run, 3, overrides, timeout=240)
    streaming = run_distributed(_run, 3, {**overrides, "commit": "streaming"}, timeout=240)
    assert atomic[0]["rounds"] >= 2  # five matrices, an owner takes at least one per round
    for a, s in zip(atomic, streaming):
        for name in SHAPES:
            assert torch.equal(a["params"][name], s["params"][name]), name
            for key, value in a["state"][name].items():
                assert torch.equal(value, s["state"][name][key]), (name, key)


def _peak(commit, shapes, steps=2):
    params = make_params(shapes=shapes)
    tensors = {n: nn.Parameter(p) for n, p in params.items()}
    opt = Muon(list(tensors.values()), lr=0.01, exchange_memory_mb=0.05, rounds_in_flight=1, commit=commit)
    for s in range(steps):
        for n, g in grads_for(s, params).items():
            tensors[n].grad = g
        opt.step()
    return opt.last_step_metrics["muon/peak_transient_bytes"], sum(len(e.tables) for e in opt.engines)


def test_streaming_drops_each_round_of_updates_once_written():
    # Equal matrices, one per round, one round in flight. The atomic commit holds every returned
    # update until the end: four rounds more, four fp32 updates more at its peak. Streaming writes
    # each round as it returns and cuts every round's buffers out of one reservation made before
    # the step (titan_muon/exchange/reservation.py), one slot per round in flight: the send buffer
    # (one process has no receive buffer), the owner area (the arrival, whose memory then holds
    # NS's iterates while on a CPU the last product writes the result straight into the return
    # buffer, and NS's workspace) and the return buffer, whatever the number of rounds; + two
    # fp32 scalars for muon/update_rms (the sum of squared updates, and the one the commit's
    # pass sums each block into).
    from titan_muon.algorithm.newton_schulz import workspace_bytes
    from titan_muon.buffers import cut_bytes

    matrix = cut_bytes((64, 96), torch.float32)
    owner = matrix + workspace_bytes(1, 64, 96, "standard", torch.float32, "cpu", reserved=True)
    reservation = matrix + owner + matrix
    peaks = {}
    for count in (4, 8):
        shapes = {f"w{i}": (64, 96) for i in range(count)}
        (peaks["atomic", count], rounds), (peaks["streaming", count], _) = _peak("atomic", shapes), _peak("streaming", shapes)
        assert rounds == count
        assert peaks["streaming", count] == reservation + 8, (count, peaks)
    assert peaks["atomic", 8] - peaks["atomic", 4] == 4 * 64 * 96 * 4, peaks
    assert peaks["streaming", 8] < peaks["atomic", 8]


def test_streaming_account_bounds_what_is_really_alive():
    # Reserved anew each step (a GPU's default), and kept from the first step (a CPU's): a kept
    # reservation is alive through the step, allocated before LiveBytes began.
    for memory, keep in itertools.product((None, 0.5), (False, True)):  # one round, then four
        params = make_params(shapes=MEMORY_SHAPES)
        tensors = {n: nn.Parameter(p) for n, p in params.items()}
        opt = Muon(list(tensors.values()), lr=0.01, exchange_memory_mb=memory, commit="streaming", keep_reservation=keep)
        for s in range(2):
            for n, g in grads_for(s, params).items():
                tensors[n].grad = g
            with LiveBytes() as live:
                opt.step()
        account, kept = (opt.last_step_metrics[f"muon/{k}_bytes"] for k in ("peak_transient", "kept_reservation"))
        assert (kept > 0) == keep
        alive = live.peak + kept
        assert alive - _verdict_bytes(tensors) <= account <= alive + _model_slack(opt), (memory, keep, live.peak, account)


def _fails_late(rank, world, failing_rank):
    """Newton–Schulz fails on `failing_rank` from its second call on: after round 0 was written."""
    import titan_muon.algorithm.orthogonalizer as module

    mesh = init_device_mesh("cpu", (world,))
    target = distributed_params(mesh, [Shard(0)])
    opt = muon_for(target, commit="streaming")
    set_grads(target, 0, mesh, [Shard(0)])
    opt.step()
    saved_params = {n: p.to_local().clone() for n, p in target.named_parameters()}
    saved_state = copy.deepcopy(opt.state_dict())  # a checkpoint: the failed step writes momentum in place
    original, calls = module.orthogonalize, []

    def broken(*args, **kwargs):
        calls.append(1)
        if rank == failing_rank and len(calls) > 1:
            raise MemoryError("injected failure")
        return original(*args, **kwargs)

    set_grads(target, 1, mesh, [Shard(0)])
    module.orthogonalize = broken
    try:
        with pytest.raises(RuntimeError) as failed:
            opt.step()
    finally:
        module.orthogonalize = original
    with pytest.raises(RuntimeError) as refused:
        opt.step()
    # Loading a checkpoint (here: the one taken before the failed step) lets it step again,
    # with the clean run's result.
    with torch.no_grad():
        for n, p in target.named_parameters():
            p.to_local().copy_(saved_params[n])
    opt.load_state_dict(saved_state)
    opt.step()
    return {"failed": str(failed.value), "refused": str(refused.value), "params": {n: p.full_tensor() for n, p in target.named_parameters()}}


def test_a_failure_after_the_first_write_is_reported_everywhere_and_refuses_further_steps():
    results = run_distributed(_fails_late, 3, 1, timeout=240)
    clean = run_distributed(_run, 3, {"commit": "streaming"}, 2, timeout=240)
    for rank, result in enumerate(results):
        assert "failed on rank 1" in result["failed"] and "partially updated" in result["failed"] and "momentum" in result["failed"], (rank, result["failed"])
        assert "Load a checkpoint" in result["refused"], (rank, result["refused"])
        for name in SHAPES:
            assert torch.equal(result["params"][name], clean[0]["params"][name]), (rank, name)


def test_commit_option_is_checked():
    with pytest.raises(ValueError, match="commit='lazy'"):
        Muon([nn.Parameter(torch.randn(4, 4))], commit="lazy")


class _NewStorages(TorchDispatchMode):
    """Once armed, every op that returns a tensor on storage of its own (not a view, not in place,
    not ``out=``) larger than a 0-dim scalar: what a step allocates."""

    def __init__(self):
        super().__init__()
        self.armed, self.seen = False, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.armed and not any(r.alias_info is not None for r in func._schema.returns):
            for t in pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes() > 8:
                    self.seen.append((str(func), tuple(t.shape)))
        return out


def _allocations_after_the_first_write(rank, world, overrides):
    from titan_muon.step.matrix_step import MatrixStep

    mesh = init_device_mesh("cpu", (world,))
    # twelve uneven matrices: four rounds or more at W = 3 (an owner takes at least one per round)
    module = distributed_params(mesh, [Shard(0)], {f"w{i}": (40 + 3 * i, 24 + i) for i in range(12)})
    opt = Muon(list(module.parameters()), lr=0.02, weight_decay=0.1, exchange_memory_mb=1e-4, rounds_in_flight=1, **overrides)
    set_grads(module, 0, mesh, [Shard(0)])
    opt.step()
    set_grads(module, 1, mesh, [Shard(0)])
    watch, original, written = _NewStorages(), MatrixStep.write_round, []

    def write_round(self, r):
        original(self, r)
        written.append(r)
        watch.armed = True

    MatrixStep.write_round = write_round
    try:
        with watch:
            opt.step()
    finally:
        MatrixStep.write_round = original
    streams, reserves = opt.commit_plan
    return {"streams": streams, "reserves": reserves, "rounds": len(written), "seen": watch.seen}


def test_a_reserved_streaming_step_allocates_nothing_after_its_first_write():
    # W = 3 over uneven shapes, several rounds: once round 0 is written, every exchange buffer,
    # batch, Newton-Schulz workspace, result and return buffer is cut from the reservation made
    # before the step's first agreement; only 0-dim scalars (the commit's lr and decay factors)
    # are still allocated. On CPU with an fp32 wire the eager element-wise passes write into
    # their outputs directly (a bf16 wire's eager rounding would allocate; on GPUs they are compiled).
    # One round in flight: rounds are still packed, computed and returned after round 0 is written.
    reserved = run_distributed(_allocations_after_the_first_write, 3, {"commit": "auto"}, timeout=240)
    for result in reserved:  # fp32 momentum on the shards: "auto" streams, reserved
        assert result["streams"] and result["reserves"] and result["rounds"] >= 4, result
        assert result["seen"] == [], result["seen"][:10]
    # The control: with overlap (momentum on the owners) streaming allocates as it goes, and the
    # same watch sees it.
    unreserved = run_distributed(_allocations_after_the_first_write, 3, {"commit": "streaming", "overlap": True}, timeout=240)
    assert all(r["streams"] and not r["reserves"] for r in unreserved)
    assert any(r["seen"] for r in unreserved)
