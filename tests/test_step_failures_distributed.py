"""An exception on one rank in the middle of step(): every rank raises, nothing changes, nobody hangs.

The failing rank keeps taking part in every exchange (sending zeros) and the ranks agree on
success before anything is written, so the others raise the same error instead of waiting.
"""

import importlib

import pytest
import torch
import torch.distributed.checkpoint as dcp
from distributed import run_distributed
from sharded_fixtures import SHAPES, distributed_params, muon_for, set_grads
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard


def _snapshot(module, opt):
    params = {n: p.to_local().clone() for n, p in module.named_parameters()}
    state = {(id(p), k): v.to_local().clone() if hasattr(v, "to_local") else v.clone() for p, s in opt.state.items() for k, v in s.items()}
    return params, state


def _unchanged(before, after):
    return all(torch.equal(before[0][n], after[0][n]) for n in before[0]) and before[1].keys() == after[1].keys() and all(
        torch.equal(before[1][k], after[1][k]) for k in before[1]
    )


def _fail_once(rank, world, where, failing_rank, path, overrides):
    mesh = init_device_mesh("cpu", (world,))
    module = distributed_params(mesh, [Shard(0)])
    opt = muon_for(module, **overrides)
    set_grads(module, 0, mesh, [Shard(0)])
    opt.step()  # a healthy step: state exists
    set_grads(module, 1, mesh, [Shard(0)])
    before = _snapshot(module, opt)

    module_name, attribute = where.split(":")
    target = importlib.import_module(module_name)
    original = getattr(target, attribute)
    setattr(target, attribute, _broken(original, rank == failing_rank))
    try:
        opt.step()
        outcome = ("ok", "")
    except RuntimeError as error:
        outcome = (type(error).__name__, str(error))
    finally:
        setattr(target, attribute, original)
    unchanged = _unchanged(before, _snapshot(module, opt))

    # State was untouched, so a checkpoint taken now and a retry give the clean run's result.
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(module, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    opt.step()
    retried = {n: p.full_tensor() for n, p in module.named_parameters()}

    fresh_module = distributed_params(mesh, [Shard(0)], seed=123)
    fresh = muon_for(fresh_module, **overrides)
    model_sd, optim_sd = get_state_dict(fresh_module, fresh)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(fresh_module, fresh, model_state_dict=state["model"], optim_state_dict=state["optim"])
    set_grads(fresh_module, 1, mesh, [Shard(0)])
    fresh.step()
    resumed = {n: p.full_tensor() for n, p in fresh_module.named_parameters()}
    return {"outcome": outcome, "unchanged": unchanged, "retried": retried, "resumed": resumed}


class _AllocationFailsOnce:
    """`torch` as one module sees it, except that its first `torch.empty` raises (an out-of-memory
    error while allocating an exchange buffer)."""

    def __init__(self, torch_module):
        self._torch, self._failed = torch_module, False

    def __getattr__(self, name):
        if name == "empty" and not self._failed:
            def empty(*args, **kwargs):
                self._failed = True
                raise MemoryError("injected failure")

            return empty
        return getattr(self._torch, name)


def _broken(original, failing):
    if not failing:
        return original
    if original is torch:
        return _AllocationFailsOnce(torch)

    def broken(*args, **kwargs):
        raise MemoryError("injected failure")

    return broken


def _clean(rank, world, overrides):
    mesh = init_device_mesh("cpu", (world,))
    module = distributed_params(mesh, [Shard(0)])
    opt = muon_for(module, **overrides)
    for step in range(2):
        set_grads(module, step, mesh, [Shard(0)])
        opt.step()
    return {n: p.full_tensor() for n, p in module.named_parameters()}


@pytest.mark.parametrize(
    "world,where,failing_rank,overrides",
    [
        (2, "titan_muon.algorithm.orthogonalizer:orthogonalize", 1, {}),
        (3, "titan_muon.algorithm.orthogonalizer:orthogonalize", 2, {"momentum_dtype": "bf16"}),
        (3, "titan_muon.algorithm.update:_into", 0, {}),
        (2, "titan_muon.algorithm.update:_into", 1, {"rounds_in_flight": 1}),
        (3, "titan_muon.buffers:torch", 1, {}),  # allocating an exchange buffer: recorded, retried once
        (2, "titan_muon.exchange.engine:assemble", 0, {}),
        (3, "titan_muon.step.commit:staged_state", 2, {"momentum_dtype": "fp8"}),
    ],
    ids=["ns-W2", "ns-W3-bf16-momentum", "packing-W3", "packing-W2-window1", "exchange-buffer-W3", "assemble-W2", "staging-fp8-W3"],
)
def test_failure_on_one_rank_raises_everywhere_and_changes_nothing(tmp_path, world, where, failing_rank, overrides):
    overrides = {"commit": "atomic", **overrides}  # the default streams; tests/test_streaming_commit.py has its failures
    results = run_distributed(_fail_once, world, where, failing_rank, str(tmp_path), overrides, timeout=240)
    clean = run_distributed(_clean, world, overrides, timeout=240)
    for rank, result in enumerate(results):
        kind, message = result["outcome"]
        assert kind == "RuntimeError", (rank, result["outcome"])
        assert f"failed on rank {failing_rank}" in message and "no parameter or optimizer state was changed" in message
        if rank == failing_rank:
            assert "injected failure" in message
        assert result["unchanged"], f"rank {rank} changed state before the error"
        for name in SHAPES:
            # Bit-identical math: the failed step left no trace.
            assert torch.equal(result["retried"][name], clean[0][name]), (rank, name)
            assert torch.equal(result["resumed"][name], clean[0][name]), (rank, name)


def test_a_reservation_that_fails_on_one_rank_raises_everywhere_before_anything_is_written(tmp_path):
    # commit="auto" with fp32 momentum on the shards streams, and reserves the step's memory
    # before the gradient verdict (titan_muon/exchange/reservation.py). The reservation is the
    # first torch.empty of titan_muon.exchange.reservation; failing on rank 1, it rides the
    # verdict's all-reduce, so every rank raises before any round is written. Reserved anew each
    # step, as on a GPU (on CPU the default keeps the first step's, so a later step takes none).
    overrides = {"commit": "auto", "keep_reservation": False}
    results = run_distributed(_fail_once, 3, "titan_muon.exchange.reservation:torch", 1, str(tmp_path), overrides, timeout=240)
    clean = run_distributed(_clean, 3, overrides, timeout=240)
    for rank, result in enumerate(results):
        kind, message = result["outcome"]
        assert kind == "RuntimeError", (rank, result["outcome"])
        assert "1 rank(s) could not reserve the memory of a streaming step" in message and "nothing was changed" in message
        assert ("injected failure" in message) == (rank == 1), message
        assert result["unchanged"], f"rank {rank} changed state before the error"
        for name in SHAPES:
            assert torch.equal(result["retried"][name], clean[0][name]), (rank, name)
            assert torch.equal(result["resumed"][name], clean[0][name]), (rank, name)
