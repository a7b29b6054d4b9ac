"""Trace the real ``Muon.step()`` of every rank, as the device would see it, without a device.

Each rank runs on ``meta`` tensors over torch's fake process group (``scale_replay/meta_device.py``):
the optimizer's own code plans, packs, exchanges, orthogonalizes and commits, and a dispatch
mode records, in issue order, what the host hands to the device:

- ``Kernel``: one aten op that launches work (views and allocations do not), with its FLOPs
  (torch's own ``flop_counter`` formulas), the bytes it reads and writes, its dtype and the
  titan_muon phase it ran in (``timing.phase`` markers); a ``titan_muon/fused:<bytes>`` range is
  one kernel moving those bytes (a pass a GPU runs as one kernel), named "compiled" where it is
  the first of a ``titan_muon/compiled_call`` range (one call of a torch.compile'd pass, whose host
  cost the replay charges there), else "fused";
- ``Collective``: a ``torch.distributed`` call, on which communicator, with the bytes this
  rank sends to and receives from each peer;
- ``Wait``: the compute stream waits for a collective (``Work.wait()``; a synchronous call);
- ``HostRead``: the host reads a device value (``.item()``, ``.tolist()``, a copy to the CPU).

Kernels, collectives and waits carry the stream they are issued on: "compute", or "relay" for
a hierarchical exchange's relay between its stages (titan_muon's ``relay`` phase), which on
CUDA runs on a stream of its own.

``scale_replay/replay.py`` replays the traces of all ranks with CUDA stream and NCCL semantics.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.debug import _clear_sharding_prop_cache
from torch.distributed.tensor.placement_types import _StridedShard
from torch.utils import _pytree as pytree
from torch.utils.flop_counter import flop_registry

from scale_replay.meta_device import DeviceAudit, meta_process_group

aten = torch.ops.aten
FUSED = "fused:"
COMPILED_CALL = "compiled_call"  # one call of a torch.compile'd pass (update.Elementwise on meta), around its kernels
_FREE = {aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default, aten.detach.default, aten._unsafe_view.default,
         aten.lift_fresh.default, aten.set_.source_Storage_storage_offset}  # fmt: skip


@dataclass(frozen=True)
class Kernel:
    name: str
    flops: int
    bytes: int
    dtype: torch.dtype
    phase: str
    stream: str = "compute"


@dataclass(frozen=True)
class Collective:
    comm: tuple  # (global ranks of the communicator, which communicator over those ranks)
    kind: str
    sent: tuple[int, ...]  # bytes to each rank of the communicator, in its rank order
    received: tuple[int, ...]
    stream: str = "compute"  # the stream the communicator's stream waits for when it is issued


@dataclass(frozen=True)
class Wait:
    collective: int  # index of the collective in this rank's trace
    stream: str = "compute"  # the stream made to wait


@dataclass(frozen=True)
class HostRead:
    pass


@dataclass
class Trace:
    rank: int
    events: list = field(default_factory=list)
    collectives: int = 0
    metrics: dict = field(default_factory=dict)  # the optimizer's last_step_metrics for the traced step
    muon_elements: int = 0  # elements of the Muon parameters' blocks this rank holds
    gradient_elements: int = 0  # elements of every parameter's block this rank holds (Muon's and AdamW's)

    def add_collective(self, collective: Collective) -> int:
        self.events.append(collective)
        self.collectives += 1
        return self.collectives - 1


class _TracedWork:
    def __init__(self, trace: Trace, index: int, work, stream):
        self.trace, self.index, self.work, self.stream = trace, index, work, stream

    def wait(self, *args, **kwargs):
        self.trace.events.append(Wait(self.index, self.stream()))
        return True if self.work is None else self.work.wait(*args, **kwargs)

    def is_completed(self) -> bool:
        return True


class _Recorder(DeviceAudit):
    """The suite's DeviceAudit (answers host reads on meta), recording kernels and host reads."""

    def __init__(self, trace: Trace):
        super().__init__("meta")
        self.trace = trace
        self.phases: list[str] = []
        self.fused = 0  # depth of titan_muon/fused ranges: the passes a GPU runs as one kernel
        self.call_started = False  # in a titan_muon/compiled_call range, before its first kernel

    def stream(self) -> str:
        return "relay" if "relay" in self.phases else "compute"

    def phase(self) -> str:
        named = [p for p in self.phases if not p.startswith(FUSED) and p != COMPILED_CALL]
        return named[-1] if named else "step"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "profiler":
            if "enter" in func.__name__:
                name = args[0].removeprefix("titan_muon/")
                if name == COMPILED_CALL:
                    self.call_started = True
                elif name.startswith(FUSED):
                    if not self.fused:  # one kernel moving what the range names; nothing inside it is recorded
                        # a compiled call's first kernel carries the call's host cost (Replay: compiled_call_s)
                        kind = "compiled" if self.call_started else "fused"
                        self.trace.events.append(Kernel(kind, 0, int(name[len(FUSED) :]), torch.float32, self.phase(), self.stream()))
                        self.call_started = False
                    self.fused += 1
                self.phases.append(name)
            elif self.phases:
                self.fused -= self.phases.pop().startswith(FUSED)
            return func(*args, **kwargs)
        reads = self.host_syncs
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if self.host_syncs > reads:
            self.trace.events.append(HostRead())
        elif func.namespace == "aten" and not func.is_view and func not in _FREE and not self.fused:
            self.trace.events.append(self._kernel(func, args, kwargs, out))
        return out

    def _kernel(self, func, args, kwargs, out) -> Kernel:
        moved = _reads(func, args, kwargs) + _writes(func, args, kwargs, out)
        formula = flop_registry.get(func._overloadpacket)
        flops = int(formula(*args, **kwargs, out_val=out)) if formula else 0
        tensors = [t for t in pytree.tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
        dtype = tensors[0].dtype if tensors else torch.float32
        return Kernel(str(func), flops, moved, dtype, self.phase(), self.stream())


def trace_kernels(fn: Callable[[], object]) -> list[Kernel]:
    """The kernels ``fn()`` launches, as the step's trace records them (``fn`` works on meta
    tensors; host reads are answered as in the meta suite)."""
    trace = Trace(rank=0)
    with _Recorder(trace):
        fn()
    return [event for event in trace.events if isinstance(event, Kernel)]


def _bytes(tree) -> int:
    """Bytes of the distinct tensors in `tree`."""
    tensors = {id(t): t for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _reads(func, args, kwargs) -> int:
    """Bytes an op reads: its tensor inputs, less an ``out=`` buffer and ``copy_``'s destination,
    which it only writes (an in-place op reads and writes its first argument: it counts in both)."""
    inputs = {k: v for k, v in kwargs.items() if k != "out"}
    if func is aten.copy_.default:
        return _bytes(args[1:])
    return _bytes((args, inputs))


def _writes(func, args, kwargs, out) -> int:
    """Bytes an op writes: what it returns and, for in-place ops that return nothing (torch's
    ``_foreach_*_``), the arguments its schema marks as written."""
    written = [a for a, spec in zip(args, func._schema.arguments) if spec.alias_info is not None and spec.alias_info.is_write]
    written += [kwargs[spec.name] for spec in func._schema.arguments if spec.kwarg_only and spec.name in kwargs and spec.alias_info is not None and spec.alias_info.is_write]
    return _bytes((out, written))


# Where the step's element-wise work happens, by the phases its kernels run in: the three sides
# of the step around Newton–Schulz, and inside NS the passes that are not its matrix products
# (normalization, casts, the symmetric products' assembly). Kernels with FLOPs — the matrix
# products — are not counted: they are the work itself.
STEP_SIDES = {
    "check": ("check_gradients",),  # the non-finite check reads every gradient once (Muon's share counted)
    "shard": ("pack",),  # momentum and Nesterov input, written into the send buffer
    "owner": ("assemble", "owner_momentum", "demo", "disassemble"),  # arrivals to NS, NS's result to the return buffer
    "commit": ("unpack", "stage_commit", "commit", "commit_round"),  # momentum, weight decay and the update
    "newton_schulz": ("newton_schulz",),  # inside NS, beside its matrix products
}
BEYOND_NS = ("check", "shard", "owner", "commit")


def bytes_per_muon_element(traces: list[Trace]) -> dict[str, float]:
    """Bytes the traced steps' kernels read and write per Muon element, by side of the step
    (``STEP_SIDES``), and "total" over the sides beyond the NS phase, over the traced ranks
    together (owners' work and shards balance across ranks, not on each one)."""
    elements = sum(t.muon_elements for t in traces)
    sides = {side: 0.0 for side in STEP_SIDES}
    for trace in traces:
        for event in trace.events:
            if isinstance(event, Kernel) and event.flops == 0:
                side = next((name for name, phases in STEP_SIDES.items() if event.phase in phases), None)
                if side == "check":  # one pass over all gradients, read alike: the Muon gradients' share
                    sides[side] += event.bytes * trace.muon_elements / max(trace.gradient_elements, 1)
                elif side is not None:
                    sides[side] += event.bytes
    per_element = {side: moved / max(elements, 1) for side, moved in sides.items()}
    return {**per_element, "total": sum(per_element[side] for side in BEYOND_NS)}


@contextlib.contextmanager
def _traced_collectives(trace: Trace, stream=lambda: "compute"):
    """Record torch.distributed's collectives (titan_muon calls them through its transport);
    `stream()` names the stream they are issued on."""
    ordinals: dict[object, tuple] = {}
    original_all_to_all, original_all_reduce = dist.all_to_all_single, dist.all_reduce

    def communicator(group) -> tuple:
        if group not in ordinals:  # the n-th communicator over these ranks: the same on every rank
            ranks = tuple(dist.get_process_group_ranks(group))
            ordinals[group] = (ranks, sum(1 for other in ordinals.values() if other[0] == ranks))
        return ordinals[group]

    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                          async_op=False):  # fmt: skip
        comm = communicator(group)
        index = trace.add_collective(Collective(comm, "all_to_all", tuple(input_split_sizes), tuple(output_split_sizes), stream()))
        work = original_all_to_all(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)
        if async_op:
            return _TracedWork(trace, index, work, stream)
        trace.events.append(Wait(index, stream()))
        return work

    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        comm = communicator(group or dist.group.WORLD)
        size = len(comm[0])
        nbytes = tensor.numel() * tensor.element_size()
        index = trace.add_collective(Collective(comm, "all_reduce", (nbytes,) * size, (nbytes,) * size, stream()))
        work = original_all_reduce(tensor, op=op, group=group, async_op=async_op)
        if async_op:
            return _TracedWork(trace, index, work, stream)
        trace.events.append(Wait(index, stream()))
        return work

    dist.all_to_all_single, dist.all_reduce = all_to_all_single, all_reduce
    try:
        yield
    finally:
        dist.all_to_all_single, dist.all_reduce = original_all_to_all, original_all_reduce


# ------------------------------------------------------------------ models on meta

# torchtitan 0.2.2's tensor-parallel plans (llama3, and deepseek_v3's for MLA), by module name:
# the weight dimension TP splits. Column-wise linears and the output split their rows, row-wise
# linears their columns, the row-wise embedding its vocabulary rows. Every other parameter (norms,
# MLA's down-projections under NoParallel, the router) is replicated over the TP ranks.
TP_SPLIT_DIM = {"wq": 0, "wk": 0, "wv": 0, "wq_b": 0, "wkv_b": 0, "w1": 0, "w3": 0, "output": 0, "tok_embeddings": 0,
                "wo": 1, "w2": 1}  # fmt: skip


@dataclass(frozen=True)
class Parallelism:
    """torchtitan 0.2.2's parallel dimensions, as far as one optimizer step sees them.

    Ranks are numbered as torchtitan's world mesh ``(pp, dp_replicate, fsdp, tp)`` numbers them,
    tp innermost: pipeline stage s holds the ranks [s·S, (s+1)·S), S = world / pp, and each stage
    has its own optimizer over its own layers. Dense parameters are FSDP2-sharded over the
    ``dp_shard`` ranks (torchtitan's ``fsdp`` mesh, dp_shard × cp: context parallel ranks shard
    like data-parallel ones), replicated over ``dp_replicate`` (HSDP), and split by the Llama TP plan
    (``TP_SPLIT_DIM``) over ``tp``. Routed experts (3-D parameters) under ``ep`` > 1 are split over
    the ``ep`` ranks, carved out of the FSDP ranks as torchtitan's sparse mesh ``(pp, dp_replicate,
    efsdp, ep)`` carves them (ep innermost; etp = 1, so tp must be 1), and FSDP2 splits each EP rank's
    experts again over the ``efsdp`` = dp_shard / ep others: along the expert dimension, so that every
    expert stays whole on one rank, unless efsdp · ep exceeds the experts, then along their rows."""

    dp_shard: int
    dp_replicate: int = 1
    tp: int = 1
    ep: int = 1
    pp: int = 1

    def __post_init__(self):
        if min(self.dp_shard, self.dp_replicate, self.tp, self.ep, self.pp) < 1:
            raise ValueError(f"{self}: every degree must be >= 1")
        if self.ep > 1 and (self.tp > 1 or self.dp_shard % self.ep):
            raise ValueError(f"{self}: expert parallel needs tp = 1 (etp = 1) and ep dividing dp_shard")

    @property
    def world(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.tp

    @property
    def stage_size(self) -> int:
        return self.world // self.pp

    @property
    def efsdp(self) -> int:
        return self.dp_shard // self.ep

    def stage_of(self, rank: int) -> int:
        return rank // self.stage_size

    def stage_ranks(self, stage: int) -> range:
        return range(stage * self.stage_size, (stage + 1) * self.stage_size)

    @property
    def name(self) -> str:
        if (self.tp, self.ep, self.pp) == (1, 1, 1):
            return "FSDP" if self.dp_replicate == 1 else f"HSDP {self.dp_shard}"
        if self.tp > 1:  # "FSDP 8 × TP 8"
            data = f"FSDP {self.dp_shard}" if self.dp_replicate == 1 else f"HSDP {self.dp_replicate} × {self.dp_shard}"
            return " × ".join(([f"PP {self.pp}"] if self.pp > 1 else []) + [data, f"TP {self.tp}"])
        parts = [f"PP{self.pp}"] if self.pp > 1 else []  # as NVIDIA names its runs: "PP4 DP64 EP64"
        parts.append(f"DP{self.dp_replicate * self.dp_shard}")
        parts += [f"EP{self.ep}"] if self.ep > 1 else []
        return " ".join(parts)


class _Meshes:
    """The meta device meshes and placements torchtitan 0.2.2 gives one rank's parameters."""

    def __init__(self, parallelism: Parallelism):
        self.parallelism = parallelism
        p = parallelism
        # Only dimensions of more than one rank (and always fsdp): a plain FSDP or HSDP run gets the
        # 1-D or 2-D mesh FSDP2 itself would build.
        dims = (("pp", p.pp), ("dp_replicate", p.dp_replicate), ("fsdp", p.dp_shard), ("tp", p.tp))
        dense = [(n, d) for n, d in dims if d > 1 or n == "fsdp"]
        world = init_device_mesh("meta", tuple(d for _, d in dense), mesh_dim_names=tuple(n for n, _ in dense))
        names = tuple(n for n, _ in dense if n != "pp")
        self.dense = world[names] if p.pp > 1 else world
        self.pipeline = world["pp"].get_group() if p.pp > 1 else None
        self.sparse = None
        if p.ep > 1:  # torchtitan keeps efsdp even when it has one rank: FSDP2 wraps the experts anyway
            sparse = [(n, d) for n, d in (("pp", p.pp), ("dp_replicate", p.dp_replicate)) if d > 1] + [("efsdp", p.efsdp), ("ep", p.ep)]
            mesh = init_device_mesh("meta", tuple(d for _, d in sparse), mesh_dim_names=tuple(n for n, _ in sparse))
            self.sparse = mesh[tuple(n for n, _ in sparse if n != "pp")]

    def placements(self, name: str, shape: tuple[int, ...]):
        """(mesh, placements) of parameter `name`, as FSDP2 (and TP, EP) leave it."""
        p = self.parallelism
        replicas = [Replicate()] if p.dp_replicate > 1 else []
        if len(shape) == 3 and p.ep > 1:
            # EP splits the experts; FSDP2 then splits each rank's experts (strided: it shards the
            # expert dimension EP already split), or their rows once efsdp · ep exceeds the experts.
            fsdp = Shard(1) if p.efsdp * p.ep > shape[0] else _StridedShard(0, split_factor=p.ep)
            return self.sparse, [*replicas, fsdp, Shard(0)]
        if p.tp == 1:
            return self.dense, [*replicas, Shard(0)]
        split = TP_SPLIT_DIM.get(name.split(".")[-2] if name.endswith(".weight") else name.split(".")[-1])
        if split is None:
            return self.dense, [*replicas, Shard(0), Replicate()]
        if split == 0:  # FSDP2 shards dim 0 after TP did: strided, so every rank still holds one row range
            return self.dense, [*replicas, _StridedShard(0, split_factor=p.tp), Shard(0)]
        return self.dense, [*replicas, Shard(0), Shard(split)]


def _sharded(shape: tuple[int, ...], mesh, placements) -> nn.Parameter:
    local_shape, _ = compute_local_shape_and_global_offset(shape, mesh, placements)
    stride = tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))
    local = torch.empty(local_shape, device="meta")
    return nn.Parameter(DTensor.from_local(local, mesh, placements, run_check=False, shape=torch.Size(shape), stride=stride))


def _param_groups(muon: list[tuple[str, tuple[int, ...]]], adamw: list[tuple[str, tuple[int, ...]]], meshes: _Meshes) -> list[dict]:
    def build(params):
        return [_sharded(shape, *meshes.placements(name, shape)) for name, shape in params]

    return [
        {"params": build(muon), "param_names": [n for n, _ in muon], "use_muon": True, "matrix_stacks": True},
        {"params": build(adamw), "param_names": [n for n, _ in adamw], "use_muon": False, "lr": 1e-3},
    ]


def trace_rank(rank: int, world: int, muon: list, adamw: list, shard_group: int | None = None,
               parallelism: Parallelism | None = None, **settings) -> Trace:  # fmt: skip
    """The events of rank `rank`'s second ``Muon.step()`` (the first creates the state) on a model
    with the `muon` and `adamw` parameters ((name, shape) pairs) sharded over `world` ranks (FSDP),
    over HSDP shard groups of `shard_group` ranks, or as `parallelism` lays them out (then `muon`
    and `adamw` are the parameters of `rank`'s pipeline stage); `settings` go to ``Muon``."""
    from titan_muon import Muon

    if parallelism is None:
        parallelism = Parallelism(world) if shard_group is None else Parallelism(shard_group, dp_replicate=world // shard_group)
    if parallelism.world != world:
        raise ValueError(f"{parallelism} has {parallelism.world} ranks, not {world}")
    # DTensor's sharding propagation caches output specs with the device mesh they were computed on;
    # a sub-mesh of another rank traced in this process compares equal to this rank's, but names
    # that rank's process groups, which no longer exist.
    _clear_sharding_prop_cache()
    with meta_process_group(rank, world):
        meshes = _Meshes(parallelism)
        groups = _param_groups(muon, adamw, meshes)
        params = [p for g in groups for p in g["params"]]
        if meshes.pipeline is not None:  # as titan_muon's torchtitan container passes it
            settings = {"pipeline_group": meshes.pipeline, **settings}
        trace = Trace(rank)
        recorder = _Recorder(Trace(rank))
        with recorder:
            optimizer = Muon(groups, lr=0.02, **settings)
            for step in range(2):
                for p in params:
                    p.grad = DTensor.from_local(torch.empty_like(p.to_local()), p.device_mesh, p.placements, run_check=False,
                                                shape=p.shape, stride=p.stride())  # fmt: skip
                recorder.trace = trace if step == 1 else Trace(rank)
                with _traced_collectives(recorder.trace, recorder.stream):
                    optimizer.step()
                optimizer.zero_grad()
            recorder.trace = Trace(rank)  # reading the metrics is the logging step's sync, not the step's
            trace.muon_elements = sum(p.to_local().numel() for p in groups[0]["params"])
            trace.gradient_elements = sum(p.to_local().numel() for p in params)
            trace.metrics = {k: float(v) for k, v in optimizer.last_step_metrics.items() if isinstance(v, (int, float))}
        return trace
