"""GPU readiness without a GPU: the whole step on `meta` tensors over a meta-only process group.

Asserted for every feature combination: no collective ever sees a tensor off the parameters'
device, the step copies nothing host->device, it reads the device from the host at most
twice (the gradient verdict and the all-ranks-succeeded check) however many matrices there
are, and its aten op count per Muon matrix stays bounded.
"""

import math

import pytest
import torch
from scale_replay.meta_device import DeviceAudit, meta_process_group
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from titan_muon import Muon, build_param_groups

# Llama-3-8B shapes (dim 4096, 32 heads of 128, 8 KV heads, MLP 14336), a few layers.
DIM, HIDDEN, KV = 4096, 14336, 1024
LAYER = {"wq": (DIM, DIM), "wk": (KV, DIM), "wv": (KV, DIM), "wo": (DIM, DIM), "w1": (HIDDEN, DIM), "w2": (DIM, HIDDEN), "w3": (HIDDEN, DIM)}
HEAD_DIM = 128
# Configurations whose aten ops per Muon matrix (a stand-in for kernel launches) are checked not
# to grow with the model (test_launches_per_matrix_do_not_grow_with_the_model).
OPS_CASES = {
    "defaults": dict(),
    "fp8-momentum": dict(momentum_dtype="fp8"),
    "overlap": dict(overlap=True),
    "split-heads": dict(row_blocks={"layers.*.wq": HEAD_DIM, "layers.*.wk": HEAD_DIM, "layers.*.wv": HEAD_DIM}),
    "hierarchical": dict(hierarchical_exchange=True, ranks_per_node=2),
}


def _sharded(shape, mesh, placements, shard_dim):
    size, index = mesh.size(shard_dim), mesh.get_local_rank(shard_dim)
    chunk = -(-shape[0] // size)
    rows = max(0, min(shape[0], (index + 1) * chunk) - min(shape[0], index * chunk))
    local = torch.empty(rows, *shape[1:], device="meta")
    stride = tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)


class MetaModel(nn.Module):
    def __init__(self, layers, mesh, placements, shard_dim):
        super().__init__()
        self.layers = nn.ModuleList()
        for _ in range(layers):
            block = nn.Module()
            for name, shape in LAYER.items():
                block.register_parameter(name, nn.Parameter(_sharded(shape, mesh, placements, shard_dim)))
            block.register_parameter("norm", nn.Parameter(_sharded((DIM,), mesh, placements, shard_dim)))
            self.layers.append(block)
        self.tok_embeddings = nn.Parameter(_sharded((2048, DIM), mesh, placements, shard_dim))


def _set_grads(model):
    for p in model.parameters():
        p.grad = DTensor.from_local(torch.empty_like(p.to_local()), p.device_mesh, p.placements, run_check=False,
                                    shape=p.shape, stride=p.stride())  # fmt: skip


def _fire_hooks(model):
    """What FSDP2 does during backward: post-accumulate-grad hooks, last layer first."""
    for p in reversed(list(model.parameters())):
        for hook in list(p._post_accumulate_grad_hooks.values()) if p._post_accumulate_grad_hooks else []:
            hook(p)


def _run(layers, world=8, rank=3, hsdp=False, audit_steps=1, fire_hooks=None, **settings):
    with meta_process_group(rank, world):
        if hsdp:
            mesh = init_device_mesh("meta", (2, world // 2))
            placements, shard_dim = [Replicate(), Shard(0)], 1
        else:
            mesh = init_device_mesh("meta", (world,))
            placements, shard_dim = [Shard(0)], 0
        model = MetaModel(layers, mesh, placements, shard_dim)
        audit = DeviceAudit()
        with audit:
            opt = Muon(build_param_groups(model, adamw_lr=1e-3), lr=1e-3, **settings)
            results = []
            for step in range(1 + audit_steps):  # the first step creates the state
                _set_grads(model)
                if settings.get("overlap") if fire_hooks is None else fire_hooks:
                    _fire_hooks(model)
                audit.reset()
                opt.step()
                if step:
                    results.append((audit.host_syncs, audit.host_to_device, list(audit.foreign_collectives), audit.op_count))
                opt.zero_grad()
        matrices = sum(len(engine.units) for engine in opt.engines)
        return results, matrices, opt


CASES = {
    "fp32": dict(),
    "standard-ns": dict(ns_algorithm="standard"),
    "bf16-momentum": dict(momentum_dtype="bf16"),
    "fp8-momentum": dict(momentum_dtype="fp8"),
    "bf16-comm-and-ns": dict(comm_dtype="bf16", ns_dtype="bf16"),
    "polar-express": dict(ns_coefficients="polar_express"),
    "split-heads": dict(row_blocks={"layers.*.wq": HEAD_DIM, "layers.*.wk": HEAD_DIM, "layers.*.wv": HEAD_DIM}),
    "overlap": dict(overlap=True),
    "overlap-fp8-split": dict(overlap=True, momentum_dtype="fp8", row_blocks={"layers.*.wq": HEAD_DIM}),
    "small-window": dict(rounds_in_flight=1, exchange_memory_mb=64),
    "skip-policy": dict(nonfinite_grads="skip"),
    "streaming-commit": dict(commit="streaming", rounds_in_flight=1, exchange_memory_mb=64),
    "streaming-overlap-fp8": dict(commit="streaming", overlap=True, momentum_dtype="fp8"),
    "adamw-foreach": dict(adamw_implementation="foreach"),
    "adamw-for-loop": dict(adamw_implementation="for-loop"),
    "hierarchical": dict(hierarchical_exchange=True, ranks_per_node=2),
    "hierarchical-overlap": dict(hierarchical_exchange=True, ranks_per_node=2, overlap=True),
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
@pytest.mark.parametrize("hsdp", [False, True], ids=["fsdp", "hsdp"])
def test_step_is_device_clean(case, hsdp):
    results, _, _ = _run(2, hsdp=hsdp, **CASES[case])
    syncs, host_to_device, foreign, _ = results[0]
    assert foreign == [], f"collectives on tensors off the device: {foreign[:3]}"
    assert host_to_device == 0
    assert syncs <= 2


@pytest.mark.parametrize("implementation,device", [("fused", "meta"), ("foreach", "cpu"), ("for-loop", "cpu")])
def test_adamw_step_counter_lives_where_its_kernel_reads_it(implementation, device):
    """As torch.optim.AdamW keeps it: fused reads it on the device, the others on the host."""
    _, _, opt = _run(1, adamw_implementation=implementation)
    steps = [opt.state[p]["step"] for group in opt.param_groups if not group["use_muon"] for p in group["params"]]
    assert steps and all(step.device.type == device for step in steps)


@pytest.mark.parametrize("case", ["fp32", "overlap"])
def test_host_syncs_do_not_grow_with_the_model(case):
    small, _, _ = _run(1, **CASES[case])
    large, _, _ = _run(4, **CASES[case])
    assert small[0][0] == large[0][0] <= 2


@pytest.mark.parametrize("case", list(OPS_CASES))
def test_launches_per_matrix_do_not_grow_with_the_model(case):
    """aten ops (a stand-in for kernel launches) per Muon matrix and step, at the shipped
    defaults (and the common variants), on 8 ranks with Llama-3-8B shapes, for 2, 6 and 12
    layers. Rounds batch equal matrices into one Newton-Schulz call per owner and the step's
    fixed work is spread over more matrices, so the count must not rise with the model (a loop
    per row block or per 256 columns, or a per-matrix cost in the fixed work, would make it). Measured on 2026-11-24:
    docs/performance.md, "Launches per matrix". The window is 8 GiB (given explicitly; the default is 2 GiB)
    so that the rounds are set by the plan's balance, not by memory: with a 1 GiB window a
    12-layer model needs more rounds than a 6-layer one, and each round's own launches (its
    collectives, packing, one NS call per shape) are spread over fewer matrices at the step
    from one round count to the next (+4 % at 12 layers), which is not what this test looks for."""
    per_matrix = {}
    for layers in (2, 6, 12):
        results, matrices, _ = _run(layers, **{"exchange_memory_mb": 8192, **OPS_CASES[case]})
        per_matrix[layers] = results[0][3] / matrices
    print(f"{case}: " + ", ".join(f"{v:.1f} at {k} layers" for k, v in per_matrix.items()) + " (aten ops per Muon matrix)")
    assert max(per_matrix[6], per_matrix[12]) <= per_matrix[2], (case, per_matrix)  # rounds are discrete: not monotone


def test_transient_memory_is_bounded_by_the_window():
    """Beyond the updates held for the commit (the rank's Muon shard, in the wire dtype), the
    step's buffers are a window of rounds: at most K outbound exchanges (send + receive),
    K + 1 return trips and one round's Newton-Schulz batches and workspace (input, Gram,
    polynomial, result in fp32) — per-round maxima, so the bound does not grow with the model."""
    for layers in (1, 4):
        _, _, opt = _run(layers, exchange_memory_mb=64, rounds_in_flight=2)
        c, k = opt.comm_dtype.itemsize, opt.rounds_in_flight
        held = sum(e.stack(e.param).numel() for e in opt.muon_params) * c
        tables = [t for engine in opt.engines for t in engine.tables]
        units = opt.engines[0].units
        outbound = max(t.send_numel + t.recv_numel for t in tables) * c
        back = max(t.send_numel + t.recv_numel for t in tables) * c
        owned = max(sum(units[u].numel for u in t.owned) for t in tables) * 4
        with DeviceAudit():  # answers the metrics' device reads
            peak = opt.last_step_metrics["muon/peak_transient_bytes"]
        assert peak - held <= k * outbound + (k + 1) * back + 5 * owned, (layers, peak, held)


class _Allocations(TorchDispatchMode):
    """Records every op that returns a new tensor of more than one element: an op that neither
    writes into one of its arguments nor returns a view of one. (0-dim results — the weight
    decay factor — are a few bytes.) Ops inside a ``titan_muon/fused`` range are not recorded:
    on an accelerator that range is one compiled element-wise kernel writing straight into its
    output (update.Elementwise), and only on ``meta`` its ops run one by one."""

    def __init__(self):
        super().__init__()
        self.allocating: list[str] = []
        self.ranges: list[str] = []  # the open profiler ranges, innermost last

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.namespace == "profiler":
            if "enter" in func.__name__:
                self.ranges.append(args[0])
            elif self.ranges:
                self.ranges.pop()
            return out
        if any(name.startswith("titan_muon/fused:") for name in self.ranges):
            return out
        schema = func._schema
        writes = any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)
        views = any(r.alias_info is not None for r in schema.returns)
        results = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        if func.namespace != "profiler" and not writes and not views and any(t.numel() > 1 for t in results):
            self.allocating.append(str(func))
        return out


@pytest.mark.parametrize("case", ["fp32", "bf16-momentum", "fp8-momentum", "overlap-fp8-split"])
def test_commit_allocates_nothing(case, monkeypatch):
    """Everything the commit would allocate is staged before the ranks agree, so an out-of-memory
    error cannot leave one rank half-committed while the others finished: the commit and the
    fused AdamW kernel only write in place."""
    import titan_muon.optimizer as optimizer_module

    recorded = []
    for name in ("commit", "adamw_step"):
        original = getattr(optimizer_module, name)

        def watched(*args, original=original, **kwargs):
            with _Allocations() as mode:
                result = original(*args, **kwargs)
            recorded.extend(mode.allocating)
            return result

        monkeypatch.setattr(optimizer_module, name, watched)
    _run(1, **CASES[case])
    assert recorded == [], f"the commit allocated: {sorted(set(recorded))}"


def _peers_of_step(monkeypatch, layers, world, rank, **settings):
    import torch.distributed as dist

    seen: list[tuple[int, set[int]]] = []
    original = dist.all_to_all_single

    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
        ranks = dist.get_process_group_ranks(group)
        me = dist.get_rank()
        peers = {r for r, out, into in zip(ranks, input_split_sizes, output_split_sizes) if r != me and (out or into)}
        seen.append((len(ranks), peers))
        return original(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)

    monkeypatch.setattr(dist, "all_to_all_single", all_to_all_single)
    results, _, opt = _run(layers, world=world, rank=rank, **settings)
    return results[0], seen, opt


@pytest.mark.parametrize("rank", [0, 29, 63])
def test_hierarchical_exchange_has_few_peers_at_64_ranks(rank, monkeypatch):
    """W = 64 on 8 nodes of 8, Llama-3-8B shapes, 10 layers (70 matrices: every rank owns some):
    every all-to-all of the step runs over a node or a rail (8 ranks), so a rank exchanges
    bytes with its 7 node-mates and 7 rail peers, against 63 peers flat — and the step stays
    device-clean (no host syncs beyond the two agreements, no host->device copies). "auto"
    keeps 64 ranks flat (the threshold is 256)."""
    (syncs, host_to_device, foreign, _), seen, opt = _peers_of_step(monkeypatch, 10, 64, rank, hierarchical_exchange=True,
                                                                    ranks_per_node=8)  # fmt: skip
    assert all(e.outbound.hierarchy is not None for e in opt.engines if e.sharded)
    assert foreign == [] and host_to_device == 0 and syncs <= 2
    assert seen and all(size == 8 for size, _ in seen)
    node = set(range(rank // 8 * 8, rank // 8 * 8 + 8)) - {rank}
    rail = set(range(rank % 8, 64, 8)) - {rank}
    assert set().union(*(p for _, p in seen)) == node | rail  # 7 + 7 peers
    _, flat_seen, flat_opt = _peers_of_step(monkeypatch, 10, 64, rank, ranks_per_node=8)  # "auto"
    assert all(e.outbound.hierarchy is None for e in flat_opt.engines)
    assert {size for size, _ in flat_seen} == {64} and len(set().union(*(p for _, p in flat_seen))) == 63
