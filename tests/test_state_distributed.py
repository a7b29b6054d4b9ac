"""Momentum storage on Shard(0) DTensors: W ranks == one process bit for bit; DCP 2 -> 1, 3, 4 ranks.

Bit for bit is the right test here: every stored value is a function of its own element only
(lerp, exactly rounded IEEE operations, block maxima, powers of two, integer-hash noise), so no
sum runs in a layout-dependent order. (Checked on AVX2 and ATEN_CPU_CAPABILITY=default, whose
scalar and vectorized kernels must agree for this to hold; docs/reliability.md.)
"""

import copy

import pytest
import torch
import torch.distributed.checkpoint as dcp
from distributed import run_distributed
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from titan_muon.state.momentum import momentum_storage

# (5, 1000) and (3, 256) leave trailing ranks empty on 4 ranks; 300 columns end in a partial block.
SHAPES = {"a": (30, 64), "b": (63, 300), "c": (3, 256), "d": (5, 1000)}
STORAGES = {
    "fp32": dict(momentum_dtype="fp32"),
    "bf16-sr": dict(momentum_dtype="bf16", rounding="stochastic"),
    "fp8": dict(momentum_dtype="fp8"),
    "fp8-nearest-row": dict(momentum_dtype="fp8", rounding="nearest", block_cols=10_000),
}
SAVED_STEPS = 3


class _MomentumOnly(torch.optim.Optimizer):
    """The optimizer's side of the contract: create state up front, load / update / store each step."""

    def __init__(self, module, storage):
        super().__init__(module.parameters(), {})
        self.storage = storage
        for p in self.param_groups[0]["params"]:
            self.state[p].update(storage.create(p))

    def step(self):
        for i, p in enumerate(self.param_groups[0]["params"]):
            grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            m = self.storage.load(self.state[p])
            m.lerp_(grad, 0.05)
            self.storage.store(self.state[p], m, stream=i)


def _grads(step):
    g = torch.Generator().manual_seed(1000 + step)
    return {n: torch.randn(s, generator=g) * torch.logspace(-3, 1, s[0]).unsqueeze(1) for n, s in SHAPES.items()}


def _module(mesh):
    module = nn.Module()
    for name, shape in SHAPES.items():
        full = torch.zeros(shape)
        module.register_parameter(name, nn.Parameter(full if mesh is None else distribute_tensor(full, mesh, [Shard(0)], src_data_rank=None)))
    return module


def _step(module, opt, mesh, step):
    for name, full in _grads(step).items():
        p = getattr(module, name)
        p.grad = full if mesh is None else distribute_tensor(full, mesh, [Shard(0)], src_data_rank=None)
    opt.step()


def _snapshot(module, opt):
    """Per parameter: the dequantized local momentum and the raw local state tensors."""
    out = {}
    for name, p in module.named_parameters():
        state = opt.state[p]
        local = {k: (v.to_local() if isinstance(v, DTensor) else v).clone() for k, v in state.items()}
        out[name] = (opt.storage.load(state).clone(), local)
    return out


def _one_process(kind, steps):
    module = _module(None)
    opt = _MomentumOnly(module, momentum_storage(**STORAGES[kind]))
    snaps = []
    for s in range(steps):
        _step(module, opt, None, s)
        snaps.append(_snapshot(module, opt))
    return snaps


def _save(rank, world, checkpoints):
    mesh = init_device_mesh("cpu", (world,))
    results = {}
    for kind, path in checkpoints.items():
        module = _module(mesh)
        opt = _MomentumOnly(module, momentum_storage(**STORAGES[kind]))
        for s in range(SAVED_STEPS):
            _step(module, opt, mesh, s)
        for key, value in opt.state[module.b].items():
            assert key == "step" or (isinstance(value, DTensor) and value.placements == (Shard(0),)), key
        model_sd, optim_sd = get_state_dict(module, opt)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
        results[kind] = _snapshot(module, opt)
    return results


def _load_and_step(rank, world, checkpoints):
    mesh = init_device_mesh("cpu", (world,))
    results = {}
    for kind, path in checkpoints.items():
        module = _module(mesh)
        opt = _MomentumOnly(module, momentum_storage(**STORAGES[kind]))
        model_sd, optim_sd = get_state_dict(module, opt)
        dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
        set_state_dict(module, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
        loaded = _snapshot(module, opt)
        _step(module, opt, mesh, SAVED_STEPS)  # resume: stochastic rounding continues where it left off
        results[kind] = (loaded, _snapshot(module, opt))
    return results


def _assert_rows_equal(rank_snaps, expected):
    """Concatenated local rows of every rank == the one-process tensors, bit for bit."""
    for name, (momentum, state) in expected.items():
        got = torch.cat([snap[name][0] for snap in rank_snaps])
        assert torch.equal(got, momentum), name
        for key, value in state.items():
            if key == "step":
                assert all(int(snap[name][1][key]) == int(value) for snap in rank_snaps)
            else:
                assert torch.equal(torch.cat([snap[name][1][key] for snap in rank_snaps]), value), (name, key)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("state_dcp")
    checkpoints = {kind: str(root / kind) for kind in STORAGES}
    ranks = run_distributed(_save, 2, checkpoints, timeout=300)
    return checkpoints, ranks, {kind: _one_process(kind, SAVED_STEPS + 1) for kind in STORAGES}


def test_two_ranks_equal_one_process_bit_for_bit(saved):
    _, ranks, reference = saved
    for kind in STORAGES:
        _assert_rows_equal([r[kind] for r in ranks], reference[kind][SAVED_STEPS - 1])


@pytest.mark.parametrize("world", [1, 3, 4])
def test_reshard_load_and_next_step_match_one_process(saved, world):
    checkpoints, _, reference = saved
    ranks = run_distributed(_load_and_step, world, checkpoints, timeout=300)
    for kind in STORAGES:
        _assert_rows_equal([r[kind][0] for r in ranks], reference[kind][SAVED_STEPS - 1])
        _assert_rows_equal([r[kind][1] for r in ranks], reference[kind][SAVED_STEPS])


def test_state_keys_identical_on_every_rank(saved):
    _, ranks, reference = saved
    for kind in STORAGES:
        expected = tuple(momentum_storage(**STORAGES[kind]).keys)
        for r in ranks:
            for name in SHAPES:
                assert tuple(r[kind][name][1]) == expected
        assert copy.deepcopy(tuple(reference[kind][0]["a"][1])) == expected
