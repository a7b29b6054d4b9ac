"""commit="streaming": each round's weights are written as its updates return.

The math is the atomic commit's, so the two must agree bit for bit (the same fused pass on the
same blocks, only earlier); the memory account drops each round's updates once written and
still bounds what is really alive; a failure after the first write is the same error on every
rank, says the parameters may be partially updated, and the optimizer refuses to step until a
checkpoint is loaded.
"""

import copy

import pytest
import torch
from common import grads_for, make_params
from distributed import run_distributed
from live_bytes import LiveBytes
from test_memory import SHAPES as MEMORY_SHAPES
from test_memory import _model_slack
from test_optimizer_distributed import SHAPES, _distributed_params, _optimizer, _set_grads
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard

from titan_muon import Muon


def _run(rank, world, overrides, steps=3):
    mesh = init_device_mesh("cpu", (world,))
    module = _distributed_params(mesh, [Shard(0)])
    opt = _optimizer(module, **overrides)
    for step in range(steps):
        _set_grads(module, step, mesh, [Shard(0)])
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
    # Eight equal matrices, one per round, one round in flight. During round r's Newton-Schulz
    # both commits hold round r - 1's pending return and (but in the last round) round r + 1's
    # arrival; the atomic one also holds the updates of rounds 0 .. r - 2. Both also keep one
    # 4-byte squared update norm per finished round (muon/update_rms). The atomic peak is at round 7
    # (round 6's bytes: one update more, no arrival, plus one more norm), streaming's at round 6
    # (the last round with an arrival): five fp32 matrices and one norm apart.
    shapes = {f"w{i}": (64, 96) for i in range(8)}
    (atomic, rounds), (streaming, _) = _peak("atomic", shapes), _peak("streaming", shapes)
    assert rounds == 8
    assert atomic - streaming == 5 * 64 * 96 * 4 + 4, (atomic, streaming)


def test_streaming_account_bounds_what_is_really_alive():
    for memory in (None, 0.5):  # one round, then four
        params = make_params(shapes=MEMORY_SHAPES)
        tensors = {n: nn.Parameter(p) for n, p in params.items()}
        opt = Muon(list(tensors.values()), lr=0.01, exchange_memory_mb=memory, commit="streaming")
        for s in range(2):
            for n, g in grads_for(s, params).items():
                tensors[n].grad = g
            with LiveBytes() as live:
                opt.step()
        account = opt.last_step_metrics["muon/peak_transient_bytes"]
        assert live.peak <= account <= live.peak + _model_slack(opt), (memory, live.peak, account)


def _fails_late(rank, world, failing_rank):
    """Newton–Schulz fails on `failing_rank` from its second call on: after round 0 was written."""
    import titan_muon.algorithm.orthogonalizer as module

    mesh = init_device_mesh("cpu", (world,))
    target = _distributed_params(mesh, [Shard(0)])
    opt = _optimizer(target, commit="streaming")
    _set_grads(target, 0, mesh, [Shard(0)])
    opt.step()
    saved_params = {n: p.to_local().clone() for n, p in target.named_parameters()}
    saved_state = copy.deepcopy(opt.state_dict())  # a checkpoint: the failed step writes momentum in place
    original, calls = module.orthogonalize, []

    def broken(*args, **kwargs):
        calls.append(1)
        if rank == failing_rank and len(calls) > 1:
            raise MemoryError("injected failure")
        return original(*args, **kwargs)

    _set_grads(target, 1, mesh, [Shard(0)])
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
