"""The sharded runs most distributed tests share: hand-made DTensor parameters with uneven shapes and
their one-process twin (`dtensor_run`, `one_process_run`, `check_equal_to_one_process`), and a small
FSDP2 transformer-like model (`fsdp_model`) with its batches and loss.
"""

import torch
from common import FP32_ULP, assert_within, grads_for, make_params, run_titan
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from titan_muon import Muon

# Uneven dim 0 (30, 63 on 2/4 ranks), fewer rows than ranks (3 on 4), wide and tall, plus AdamW tensors.
SHAPES = {"a": (30, 64), "b": (63, 64), "c": (3, 256), "d": (64, 30), "e": (48, 48), "emb": (50, 16), "bias": (17,)}
MUON = {"a", "b", "c", "d", "e"}
SETTINGS = dict(lr=0.02, weight_decay=0.1, momentum=0.9, adjust_lr_fn="match_rms_adamw", exchange_memory_mb=0.01)


def distributed_params(mesh, placements, shapes=SHAPES, seed=0):
    module = nn.Module()
    for name, full in make_params(seed, shapes).items():
        module.register_parameter(name, nn.Parameter(distribute_tensor(full, mesh, placements, src_data_rank=None)))
    return module


def muon_for(module, **overrides):
    named = dict(module.named_parameters())
    groups = [
        {"params": [(n, named[n]) for n in named if n in MUON]},
        {"params": [(n, named[n]) for n in named if n not in MUON], "use_muon": False},
    ]
    return Muon(groups, **{**SETTINGS, **overrides})


def set_grads(module, step, mesh, placements):
    full = grads_for(step, dict(module.named_parameters()))
    for name, p in module.named_parameters():
        p.grad = distribute_tensor(full[name], mesh, placements, src_data_rank=None)


def dtensor_run(rank, world, mesh_shape, steps, overrides):
    mesh = init_device_mesh("cpu", mesh_shape)
    placements = [Shard(0)] if len(mesh_shape) == 1 else [Replicate(), Shard(0)]
    module = distributed_params(mesh, placements)
    opt = muon_for(module, **overrides)
    measured = []
    for s in range(steps):
        set_grads(module, s, mesh, placements)
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


def one_process_run(steps, **overrides):
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


def token_batches(step, batch=12, seq=5, vocab=40):
    g = torch.Generator().manual_seed(7 + step)
    return torch.randint(0, vocab, (batch, seq + 1), generator=g)


def next_token_loss(model, tokens):
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
