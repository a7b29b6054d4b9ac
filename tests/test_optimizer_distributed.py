"""W ranks (gloo, CPU) compute what one process computes: hand-made DTensors, HSDP, a real FSDP2 model.

Every run goes through tests/distributed.py, which kills all ranks and fails after a timeout.
"""

import pytest
import torch
from common import (
    FP32_ULP,
    adamw_names,
    assert_within,
    feed_adamw_gradients,
    grads_for,
    make_params,
    run_titan,
    whole_gradients,
)
from distributed import run_distributed
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from titan_muon import Muon

# Uneven dim 0 (30, 63 on 2/4 ranks), fewer rows than ranks (3 on 4), wide and tall, plus AdamW tensors.
SHAPES = {"a": (30, 64), "b": (63, 64), "c": (3, 256), "d": (64, 30), "e": (48, 48), "emb": (50, 16), "bias": (17,)}
MUON = {"a", "b", "c", "d", "e"}
SETTINGS = dict(lr=0.02, weight_decay=0.1, momentum=0.9, adjust_lr_fn="match_rms_adamw", exchange_memory_mb=0.01)


def _distributed_params(mesh, placements, shapes=SHAPES, seed=0):
    module = nn.Module()
    for name, full in make_params(seed, shapes).items():
        module.register_parameter(name, nn.Parameter(distribute_tensor(full, mesh, placements, src_data_rank=None)))
    return module


def _optimizer(module, **overrides):
    named = dict(module.named_parameters())
    groups = [
        {"params": [(n, named[n]) for n in named if n in MUON]},
        {"params": [(n, named[n]) for n in named if n not in MUON], "use_muon": False},
    ]
    return Muon(groups, **{**SETTINGS, **overrides})


def _set_grads(module, step, mesh, placements):
    full = grads_for(step, dict(module.named_parameters()))
    for name, p in module.named_parameters():
        p.grad = distribute_tensor(full[name], mesh, placements, src_data_rank=None)


def _dtensor_run(rank, world, mesh_shape, steps, overrides):
    mesh = init_device_mesh("cpu", mesh_shape)
    placements = [Shard(0)] if len(mesh_shape) == 1 else [Replicate(), Shard(0)]
    module = _distributed_params(mesh, placements)
    opt = _optimizer(module, **overrides)
    measured = []
    for s in range(steps):
        _set_grads(module, s, mesh, placements)
        opt.measure_update_rms = s % 2 == 1  # muon/update_rms on every other step: skipping it changes no weight
        opt.step()
        measured.append("muon/update_rms" in opt.last_step_metrics)
    local_muon_bytes = sum(p.to_local().numel() * 4 for n, p in module.named_parameters() if n in MUON)
    return {
        "params": {n: p.full_tensor() for n, p in module.named_parameters()},
        "bytes_sent": opt.last_step_metrics["muon/bytes_sent"],
        "local_muon_bytes": local_muon_bytes,
        "measured": measured,
    }


def _one_process(steps, **overrides):
    params = make_params(0, SHAPES)
    out, _ = run_titan(params, steps, MUON, **{**SETTINGS, **overrides})
    return out


def check_equal_to_one_process(params, expected, steps, what):
    """Every rank was given the one-process gradients, so only fp32 rounding may differ.

    Muon: Newton-Schulz of each matrix runs on its owner, batched with other matrices, in
    another place in memory and maybe another GEMM blocking; each of `steps` steps moves a
    matrix by <= lr·0.2·sqrt(256)·1.2 ≈ 0.08 (1.2: Keller's largest singular value). NS
    moves a perturbation of these full-rank random inputs by <= ~30x (docs/reliability.md),
    so rounding (2^-23) changes a parameter by <= ~1e-6; a wrong update changes it by ~1e-2.
    AdamW: elementwise on row shards of the same inputs: at most the last bit of p after each
    of its two roundings a step (weight decay, update).
    """
    for name, tensor in expected.items():
        bound = 1e-5 if name in MUON else steps * 2 * FP32_ULP * tensor.abs().max().item()
        assert_within(params[name], tensor, bound, f"{what} {name}")


@pytest.mark.parametrize("world", [2, 3, 4])
def test_sharded_run_equals_one_process(world):
    results = run_distributed(_dtensor_run, world, (world,), 4, {})
    expected = _one_process(4)
    for r, result in enumerate(results):
        check_equal_to_one_process(result["params"], expected, 4, f"W={world} rank {r}")
        assert result["measured"] == [False, True, False, True]
        # Communication accounting: outbound shards + returning rows of owned matrices.
        ratio = result["bytes_sent"] / result["local_muon_bytes"]
        print(f"W={world} rank {r}: Muon bytes sent {result['bytes_sent']:.0f} = {ratio:.2f}x local shard bytes")
        assert 0 < result["bytes_sent"] <= 2 * result["local_muon_bytes"]


def test_fp8_momentum_distributed_equals_fp8_one_process():
    """Row-following scales and layout-independent stochastic rounding: W ranks == one process."""
    results = run_distributed(_dtensor_run, 3, (3,), 4, {"momentum_dtype": "fp8"})
    expected = _one_process(4, momentum_dtype="fp8")
    for r, result in enumerate(results):
        check_equal_to_one_process(result["params"], expected, 4, f"rank {r}")


def test_gram_newton_schulz_distributed_equals_one_process():
    """ns_algorithm="gram" on every shape (auto would pick it only from 128 rows): the owner
    runs the same kernels as one process, so the same fp32 bound applies."""
    results = run_distributed(_dtensor_run, 3, (3,), 3, {"ns_algorithm": "gram"})
    expected = _one_process(3, ns_algorithm="gram")
    for r, result in enumerate(results):
        check_equal_to_one_process(result["params"], expected, 3, f"rank {r}")


def test_hsdp_mesh_equals_one_process():
    results = run_distributed(_dtensor_run, 4, (2, 2), 3, {})
    expected = _one_process(3)
    for r, result in enumerate(results):
        check_equal_to_one_process(result["params"], expected, 3, f"rank {r}")


def test_bf16_communication_and_polar_express_stay_close_to_one_process():
    overrides = {"comm_dtype": "bf16", "ns_coefficients": "polar_express"}
    results = run_distributed(_dtensor_run, 2, (2,), 2, overrides)
    expected = _one_process(2, ns_coefficients="polar_express")
    for name in MUON:
        delta = expected[name] - make_params(0, SHAPES)[name]
        # bf16 keeps 8 bits: the matrices NS receives and the updates it returns are each
        # rounded by <= 2^-9 relative, which moves an update by a few times that: 2 % of the
        # parameter's total change bounds it (fp32 rounding is ~1e-5 of that).
        assert_within(results[0]["params"][name], expected[name], 0.02 * delta.abs().max().item(), name)


# ---------------------------------------------------------------- a real FSDP2 model


class Block(nn.Module):
    def __init__(self, dim, hidden, kv):
        super().__init__()
        self.norm = nn.RMSNorm(dim)
        self.wq, self.wk, self.wo = nn.Linear(dim, dim, bias=False), nn.Linear(dim, kv, bias=False), nn.Linear(kv, dim, bias=False)
        self.w1, self.w2 = nn.Linear(dim, hidden, bias=True), nn.Linear(hidden, dim, bias=False)

    def forward(self, h):
        x = self.norm(h)
        h = h + self.wo(torch.tanh(self.wk(x))) + self.wq(x).relu()
        return h + self.w2(nn.functional.gelu(self.w1(self.norm(h))))


class TinyTransformerish(nn.Module):
    """Uneven shapes on purpose: 63 hidden rows, 6 KV rows, a 40-row output head."""

    def __init__(self, vocab=40, dim=24, hidden=63, kv=6):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList([Block(dim, hidden, kv) for _ in range(2)])
        self.norm = nn.RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    skip: frozenset = frozenset()  # layers left out of the forward (tests of parameters without gradients)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for i, block in enumerate(self.layers):
            if i not in self.skip:
                h = block(h)
        return self.output(self.norm(h))


def _batches(step, batch=12, seq=5, vocab=40):
    g = torch.Generator().manual_seed(7 + step)
    return torch.randint(0, vocab, (batch, seq + 1), generator=g)


def _loss(model, tokens):
    logits = model(tokens[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1))


def fsdp_model(world):
    """TinyTransformerish with the one-process initialization, FSDP2-sharded per block and at the root."""
    torch.manual_seed(0)
    model = TinyTransformerish()
    mesh = init_device_mesh("cpu", (world,))
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
    return model


def _fsdp_run(rank, world, steps):
    from titan_muon import build_param_groups

    model = fsdp_model(world)
    opt = Muon(build_param_groups(model, adamw_lr=3e-3), lr=0.02, adjust_lr_fn="match_rms_adamw")
    reduced = []
    for s in range(steps):
        tokens = _batches(s).chunk(world)[rank]
        _loss(model, tokens).backward()
        reduced.append(whole_gradients(model, adamw_names(opt)))
        opt.step()
        opt.zero_grad()
    return {"params": {n: p.full_tensor() for n, p in model.named_parameters()}, "adamw_grads": reduced}


FSDP_STEPS = 3


@pytest.mark.parametrize("world", [2, 3])
def test_fsdp2_model_equals_one_process(world):
    """The one-process AdamW is fed the gradients the W ranks reduced (common.feed_adamw_gradients):
    its own are checked against them, and its parameters must then agree to a few ulps."""
    from titan_muon import build_param_groups

    results = run_distributed(_fsdp_run, world, FSDP_STEPS)
    torch.manual_seed(0)
    model = TinyTransformerish()
    opt = Muon(build_param_groups(model, adamw_lr=3e-3), lr=0.02, adjust_lr_fn="match_rms_adamw")
    for s in range(FSDP_STEPS):
        _loss(model, _batches(s)).backward()
        feed_adamw_gradients(model, opt, results[0]["adamw_grads"][s], f"W={world} step {s}")
        opt.step()
        opt.zero_grad()
    adamw = set(adamw_names(opt))
    for name, p in model.named_parameters():
        for result in results:
            if name in adamw:
                # Same gradients, elementwise math on shards: at most the last bit of p after
                # each of its two roundings a step (weight decay, update).
                bound = FSDP_STEPS * 2 * FP32_ULP * p.abs().max().item()
            else:
                # Muon gradients are summed in another order too (~1e-6 relative); NS normalizes
                # them, and each of 3 steps moves a matrix by <= lr·0.2·sqrt(63)·1.2 ≈ 0.04, so
                # rounding moves parameters by ~1e-7; a wrong update would move them by ~1e-2.
                bound = 1e-5
            assert_within(result["params"][name], p.detach(), bound, f"W={world} {name}")
