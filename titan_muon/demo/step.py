"""DeMo inside Muon's step: the owners' part, the agreement across replicas, AdamW's average.

With ``Muon(..., demo=True, replicate_group=...)`` the optimizer owns the replicate
dimension: FSDP2 runs on one replica's shard mesh only, so every replica arrives at ``step()``
with its own gradients (docs/demo.md). Muon's exchange assembles each whole raw gradient on
its owner inside the replica, as with momentum on the owners (overlap.py), and there, per
round and per batch of equal-shape matrices (:meth:`Replicas.round_inputs`):

    M ← βM + g; payload = top-k of chunk DCTs of M; M ← M − α·decode(payload)   demo.local_step_
    one all-gather of the round's payloads over the replicate group
    q = mean over replicas of decode(payload_r)                                   demo.average_decoded
    S ← μS + (1 − μ)q; input = (1 − μ)q + μS (Nesterov) or S     demo.shared_momentum_input_

(the shared momentum S, with ``demo_shared_momentum``, is the same on every replica and kept
on the owners next to the replica's own buffer M, under the state key ``SHARED_MOMENTUM_KEY``).
With ``demo_compressor="low_rank"`` the round's payload is low_rank.py's instead: one all-reduce
of every right factor Q_r = AᵀP of the round, the QR basis Q̂, one all-reduce of every left
factor P_r = AQ̂, q = P̄Q̂ᵀ, the warm start P̄ kept on the owners (``LEFT_FACTOR_KEY``).
AdamW gradients are averaged over the replicas before the exchange, densely or, with
``demo_adamw="sign"``, as sign.py's payloads (one all-gather per step).
The input goes on to Newton–Schulz, and the update back through the exchange's return trip. The plan
is the same in every replica, so the owner of a matrix sits at the same place in each, and the
replicate group (the ranks at one place) is exactly that matrix's owners. The new momentum is
staged and swapped in at the commit, like every other state change.

Collectives across replicas must match even when a rank fails: every owner gathers once per
round in which it owns matrices, with a zero payload after a local failure (:meth:`settle`),
and the step's two agreements run over all replicas (transport.AcrossReplicas), so a failure
or a non-finite gradient anywhere stops or skips the step in every replica alike.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from titan_muon.step.commit import staged_state
from titan_muon.base.dtensor import local_shard
from titan_muon.demo import dct as demo
from titan_muon.demo import low_rank, sign
from titan_muon.demo.low_rank import LEFT_FACTOR_KEY
from titan_muon.exchange.engine import ExchangeEngine, StepFailure
from titan_muon.exchange.redistribute import Batch
from titan_muon.exchange.transport import Transport
from titan_muon.state.momentum import Fp32Storage

# The paper found larger β clearly better with its error feedback (0.995–0.999; it used 0.999).
SMALL_BETA_WARNING = 0.99
# The owners' state key of the shared momentum: replica-identical, so saved once (not per replica).
SHARED_MOMENTUM_KEY = "demo_shared_momentum"


@dataclass(frozen=True)
class DemoSettings:
    chunk: int = demo.DEFAULT_CHUNK
    topk: int = demo.DEFAULT_TOPK
    alpha: float = demo.DEFAULT_ALPHA
    shared_momentum: bool = demo.DEFAULT_SHARED_MOMENTUM
    compressor: str = low_rank.DEFAULT_COMPRESSOR  # "dct" (chunked DCT top-k) or "low_rank"
    rank: int = low_rank.DEFAULT_RANK  # low_rank's k (demo_rank)
    adamw: str = sign.DEFAULT_ADAMW  # "dense" or "sign": how the AdamW gradients cross replicas (demo_adamw)

    @property
    def fingerprint(self) -> tuple:
        """What every replica must agree on (Replicas.check_consistent): numbers only, since Python
        salts the hashes of strings per process."""
        return (self.chunk, self.topk, self.alpha, self.shared_momentum, low_rank.COMPRESSORS.index(self.compressor), self.rank,
                sign.ADAMW_CHOICES.index(self.adamw))  # fmt: skip


def demo_settings(enabled, chunk, topk, alpha, replicate_group, *, momentum_dtype: str, overlap: bool,
                  shared_momentum: bool = demo.DEFAULT_SHARED_MOMENTUM, compressor: str = low_rank.DEFAULT_COMPRESSOR,
                  rank: int = low_rank.DEFAULT_RANK, adamw: str = sign.DEFAULT_ADAMW) -> DemoSettings | None:  # fmt: skip
    """The settings of ``Muon(demo=...)``, or None when off; ValueError naming the option otherwise."""
    if not isinstance(enabled, bool):
        raise ValueError(f"titan_muon.Muon: demo must be True or False, got {enabled!r}")  # noqa: TRY004 - a bad option value
    if not enabled:
        if replicate_group is not None:
            raise ValueError("titan_muon.Muon: replicate_group is only used with demo=True (DeMo owns the replicate dimension)")
        return None
    if not isinstance(shared_momentum, bool):
        raise ValueError(f"titan_muon.Muon: demo_shared_momentum must be True or False, got {shared_momentum!r}")  # noqa: TRY004
    if not isinstance(compressor, str) or compressor not in low_rank.COMPRESSORS:
        raise ValueError(f"titan_muon.Muon: demo_compressor must be one of {low_rank.COMPRESSORS}, got {compressor!r}")
    if not isinstance(adamw, str) or adamw not in sign.ADAMW_CHOICES:
        raise ValueError(f"titan_muon.Muon: demo_adamw must be one of {sign.ADAMW_CHOICES}, got {adamw!r}")
    try:
        demo.validate_settings(chunk, topk, alpha)
        low_rank.validate_rank(rank)
    except ValueError as error:
        raise ValueError(f"titan_muon.Muon: {error}") from None
    replicas = dist.get_world_size(replicate_group) if replicate_group is not None and dist.is_initialized() else 1
    if replicas < 2:
        raise ValueError(
            "titan_muon.Muon: demo=True needs replicate_group, a process group over this rank and the ranks at the "
            f"same place in the other replicas, with at least 2 ranks (got {'None' if replicate_group is None else replicas}); "
            "FSDP2 must be applied on each replica's shard mesh only (docs/demo.md)"
        )
    if momentum_dtype != "fp32":
        raise ValueError(
            f"titan_muon.Muon: demo=True needs momentum_dtype='fp32', got {momentum_dtype!r}: DeMo's momentum is its "
            "error feedback (what was not sent yet), which bf16/fp8 rounding would lose"
        )
    if overlap:
        raise ValueError("titan_muon.Muon: demo=True does not support overlap=True yet (gradients are sent in step())")
    return DemoSettings(chunk, topk, float(alpha), shared_momentum, compressor, rank, adamw)


class DemoStorage(Fp32Storage):
    """fp32 momentum plus DeMo's replica-identical state, all following the parameter's rows and
    moved between owners and shards together: the shared momentum (``SHARED_MOMENTUM_KEY``, as
    wide as the parameter) and the low-rank compressor's warm-started left factor
    (``LEFT_FACTOR_KEY``, ``rank`` columns; a matrix uses the first k = min(rank, rows, cols)).
    ``load``/``store`` are the replica's own buffer's (Fp32Storage's); the others are staged by
    :meth:`Replicas.round_inputs`."""

    replica_keys = ("momentum_buffer",)  # different in every replica: saved per replica (Replicas.stacked)

    def __init__(self, shared_momentum: bool, left_factor_rank: int | None):
        self.shared_momentum, self.left_factor_rank = shared_momentum, left_factor_rank
        self.keys = ("momentum_buffer", *((SHARED_MOMENTUM_KEY,) if shared_momentum else ()), *((LEFT_FACTOR_KEY,) if left_factor_rank else ()))

    def _zeros(self, cols, zeros_with_rows):
        state = {"momentum_buffer": zeros_with_rows(cols, torch.float32)}
        if self.shared_momentum:
            state[SHARED_MOMENTUM_KEY] = zeros_with_rows(cols, torch.float32)
        if self.left_factor_rank:
            state[LEFT_FACTOR_KEY] = zeros_with_rows(self.left_factor_rank, torch.float32)
        return state

    def state_columns(self, width, cols, col_range):
        """The left factor belongs to whole rows: a rank holding only some columns of a row
        (tensor-parallel column shards) cannot hold a share of it."""
        if width == cols or not self.left_factor_rank:
            return super().state_columns(width, cols, col_range)
        if tuple(col_range) != (0, cols):
            raise ValueError(
                f"titan_muon.Muon: demo_compressor='low_rank' needs whole rows of every Muon matrix on a rank, but a rank "
                f"holds columns [{col_range[0]}, {col_range[1]}) of {cols} (tensor-parallel column shards); use "
                "demo_compressor='dct'"
            )
        return 0, width

    def bytes_per_element(self, rows, cols):
        return 4.0 * (1 + self.shared_momentum) + (4.0 * self.left_factor_rank / cols if self.left_factor_rank else 0.0)


def demo_storage(settings: DemoSettings):
    """The momentum storage of a DeMo optimizer (fp32 only, demo_settings checked that)."""
    rank = settings.rank if settings.compressor == "low_rank" else None
    return DemoStorage(settings.shared_momentum, rank) if settings.shared_momentum or rank else Fp32Storage()


def replica_keys(storage) -> tuple[str, ...]:
    """The state keys that differ between replicas (saved per replica); the others are the same in all."""
    return getattr(storage, "replica_keys", storage.tensor_keys)


def check_groups(param_groups: list[dict], settings: DemoSettings) -> None:
    """Per Muon group. Without the shared momentum: no Nesterov (DeMo then orthogonalizes the
    replicas' average as it is) and a warning when β is below the range the paper found to work.
    With it, the group's momentum and nesterov are the shared momentum's (and the local buffer's β)."""
    for index, group in enumerate(param_groups):
        if not group["use_muon"] or settings.shared_momentum:
            continue
        if group["nesterov"]:
            raise ValueError(
                f"titan_muon.Muon: param group {index}: nesterov=True with demo=True needs demo_shared_momentum=True "
                "(Nesterov runs on the shared momentum); without it DeMo orthogonalizes the average of what the "
                "replicas sent as it is: pass nesterov=False or demo_shared_momentum=True"
            )
        if group["momentum"] < SMALL_BETA_WARNING:
            warnings.warn(
                f"titan_muon.Muon: param group {index}: demo=True with momentum={group['momentum']}; the DeMo paper "
                "used 0.999 and found 0.995-0.999 clearly better than smaller values with its error feedback",
                UserWarning,
                stacklevel=4,
            )


@dataclass
class _Round:
    """One round's owned batches on this owner and where their state lives and is staged."""

    s: int
    r: int
    engine: ExchangeEngine
    batches: list[Batch]
    owner_blocks: dict
    params: list
    skipped: set[int]
    storage: object
    work: object

    def group(self, batch: Batch) -> dict:
        return self.params[self.engine.units[batch.units[0]].param].group

    def stacked(self, batch: Batch, key: str) -> Tensor:
        """A stacked copy (b, rows, width) of the batch's owner state `key` (the old stays until the commit)."""
        out = torch.stack([self.owner_blocks[(self.s, u)][key] for u in batch.units])
        self.work.memory.add(out.numel() * out.element_size())
        return out

    def momenta(self, batch: Batch) -> Tensor:
        return torch.stack([self.owner_blocks[(self.s, u)]["momentum_buffer"] for u in batch.units])

    def stage_momentum(self, batch: Batch, momentum: Tensor) -> None:
        """Each matrix's new own buffer, for the commit (a skipped parameter keeps its old one)."""
        for u, new in zip(batch.units, momentum.unbind(0)):
            unit = self.engine.units[u]
            entry = self.params[unit.param]
            if id(entry.param) not in self.skipped:
                state = self.owner_blocks[(self.s, u)]
                first_row = unit.matrix * entry.param.shape[-2] + unit.row_start
                self.work.staged.append((state, staged_state(self.storage, state, new, unit.param, first_row, self.work.memory)))

    def stage(self, batch: Batch, key: str, value: Tensor) -> None:
        """Each matrix's new replica-identical state `key` (counted by :meth:`stacked` or its maker)."""
        for u, new in zip(batch.units, value.unbind(0)):
            if id(self.params[self.engine.units[u].param].param) not in self.skipped:
                self.work.staged.append((self.owner_blocks[(self.s, u)], {key: new}))


class Replicas:
    """DeMo's traffic across replicas for one optimizer: the owners' payloads, AdamW's average."""

    def __init__(self, settings: DemoSettings, group: dist.ProcessGroup, device: torch.device):
        self.settings = settings
        self.transport = Transport(group, device)
        self.count = self.transport.world_size
        self._meshes: dict[object, DeviceMesh] = {}
        self.begin_step()

    # ------------------------------------------------------------ construction

    def check_consistent(self, params: list[Tensor], names: list[str], plan_fingerprint: int) -> None:
        """Every replica has the same plan and settings and starts from the same parameters (one
        all-reduce each, read once): a replica that differs would silently drift away."""
        s = self.settings
        self.transport.check_same_everywhere(hash((plan_fingerprint, *s.fingerprint)) & (2**62 - 1), "the DeMo plan or settings")
        tensors = [local_shard(p) for p in params]
        if not tensors or any(t.device.type == "meta" for t in tensors):
            return
        sums = []
        for t in tensors:  # Σx and Σ(i+1)·x over the flat local block, in float64
            flat = t.detach().reshape(-1).double()
            weights = torch.arange(1, flat.numel() + 1, dtype=torch.float64, device=flat.device)
            sums.append(torch.stack([flat.sum(), flat @ weights]) if flat.numel() else flat.new_zeros(2))
        local = torch.cat(sums)
        both = self.transport.all_reduce(torch.cat([local, -local]), dist.ReduceOp.MAX)
        high, low = both[: local.numel()], -both[local.numel() :]
        differ = (high != low).reshape(-1, 2).any(dim=1).tolist()
        if any(differ):
            first = names[differ.index(True)]
            raise ValueError(
                f"titan_muon.Muon: with demo=True parameters must start bit-identical in every replica, but {first!r} "
                "differs between replicas; initialize every replica with the same seed (or broadcast from one)"
            )

    # ------------------------------------------------------------ the step

    def begin_step(self) -> None:
        self.collectives_done: dict[tuple[int, int], int] = {}  # (rank set, round) -> its collectives run so far
        self.dense_bytes = 0  # what a dense all-reduce would have carried of those rounds' matrices
        self.payload_sent = 0  # dct: the payloads' all-gathers, as sent ((R − 1) × payload)
        self.allreduced_bytes = 0  # low_rank: the factors all-reduced (before the ring's 2(R − 1)/R)
        self.adamw_bytes = 0  # dense AdamW gradients all-reduced (before the ring's 2(R − 1)/R)
        self.adamw_sent = 0  # sign-compressed AdamW payloads all-gathered, as sent ((R − 1) × payload)
        self.adamw_dense_bytes = 0  # every AdamW gradient as dense fp32 (what a full sync would all-reduce)
        self.transport.bytes_sent = self.transport.bytes_received = 0

    def round_inputs(self, s: int, r: int, engine: ExchangeEngine, batches: list[Batch], owner_blocks: dict, params: list,
                     skipped: set[int], storage, work) -> list[Tensor]:  # fmt: skip
        """Newton–Schulz's input for each of round r's batches (whole fp32 gradients on this
        owner), staging each matrix's new state in ``work`` (kept as is for parameters in ``skipped``)."""
        if not engine.tables[r].owned:  # nor does this place in any replica: no exchange
            return []
        round_ = _Round(s, r, engine, batches, owner_blocks, params, skipped, storage, work)
        if self.settings.compressor == "low_rank":
            out = self._low_rank_averages(round_)
        else:
            out = self._dct_averages(round_)
        if self.settings.shared_momentum:
            out = [self._shared_momentum_input(round_, batch, q) for batch, q in zip(batches, out)]
        return out

    def _dct_averages(self, round_: _Round) -> list[Tensor]:
        """q per batch: the average of the replicas' decoded top-k DCT payloads (one all-gather)."""
        settings = self.settings
        s, r, engine = round_.s, round_.r, round_.engine
        try:
            values, indices = [], []
            for batch in round_.batches:
                momentum = round_.momenta(batch)  # new; the old stays
                i, v = demo.local_step_(momentum, batch.matrices, round_.group(batch)["momentum"], settings.chunk, settings.topk, settings.alpha)
                round_.stage_momentum(batch, momentum)
                values.append(v)
                indices.append(i)
            send = self._pack(values, indices, self._collective_sizes(engine, r)[0])
        except BaseException:
            self.settle(s, r, engine)  # the other replicas' owners wait for this round's payload
            raise
        gathered = self._collective(s, r, engine, send)
        round_.work.memory.add(gathered.numel())  # freed once q is decoded (copies of blocks not counted)
        # A replica's block starts at a multiple of the payload's size, which need not be a
        # multiple of 4: such blocks are copied once so that the fp32 views are aligned.
        gathered = [row if row.storage_offset() % 4 == 0 else row.clone() for row in gathered]
        out, offsets = [], self._offsets(values, indices)
        for batch, value, index, (v0, i0) in zip(round_.batches, values, indices, offsets):
            shape = tuple(batch.matrices.shape[1:])
            vs = [row[v0 : v0 + value.numel() * 4].view(torch.float32).view(value.shape) for row in gathered]
            ids = [row[i0 : i0 + index.numel() * index.element_size()].view(index.dtype).view(index.shape) for row in gathered]
            out.append(demo.average_decoded(ids, vs, shape, settings.chunk, settings.topk))
        round_.work.memory.free(sum(row.numel() for row in gathered))
        return out

    def _low_rank_averages(self, round_: _Round) -> list[Tensor]:
        """q per batch: the replicas' average momentum projected on a shared rank-k basis
        (low_rank.py), with one all-reduce of every right factor Q_r of the round and one of every
        left factor P_r. The new momentum A − α·q and the warm start P̄ are staged."""
        s, r, engine, settings = round_.s, round_.r, round_.engine, self.settings
        try:
            accumulated, rights = [], []
            for batch in round_.batches:
                rows, cols = batch.matrices.shape[1:]
                k = low_rank.effective_rank(rows, cols, settings.rank)
                momentum = round_.momenta(batch)  # new; the old stays
                demo.accumulate_momentum_(momentum, batch.matrices, round_.group(batch)["momentum"])
                factors = low_rank.warm_start(round_.stacked(batch, LEFT_FACTOR_KEY)[..., :k])
                accumulated.append(momentum)
                rights.append(low_rank.right_projection(momentum, factors))
            right = torch.cat([q.reshape(-1) for q in rights])
        except BaseException:
            self.settle(s, r, engine)  # the other replicas' owners wait for both of this round's all-reduces
            raise
        right = self._collective(s, r, engine, right)
        try:
            bases = [low_rank.orthonormal_basis(part.view_as(q)) for part, q in zip(right.split([q.numel() for q in rights]), rights)]
            left = torch.cat([low_rank.left_projection(a, basis).reshape(-1) for a, basis in zip(accumulated, bases)])
        except BaseException:
            self.settle(s, r, engine)
            raise
        left = self._collective(s, r, engine, left)
        out = []
        sizes = [a.shape[0] * a.shape[1] * basis.shape[2] for a, basis in zip(accumulated, bases)]
        for batch, momentum, basis, part in zip(round_.batches, accumulated, bases, left.split(sizes)):
            average_left = part.view(momentum.shape[0], momentum.shape[1], basis.shape[2])
            q = low_rank.decode(average_left, basis)
            demo.subtract_sent_(momentum, q, settings.alpha)
            round_.stage_momentum(batch, momentum)
            warm = average_left.new_zeros(*average_left.shape[:2], settings.rank)
            round_.work.memory.add(warm.numel() * 4)
            warm[..., : basis.shape[2]] = average_left
            round_.stage(batch, LEFT_FACTOR_KEY, warm)
            out.append(q)
        return out

    def _shared_momentum_input(self, round_: _Round, batch: Batch, average: Tensor) -> Tensor:
        """Newton–Schulz's input for one batch from the shared momentum over `average` (q), the new
        shared momentum staged for the commit (a skipped parameter keeps its old one). Runs after a
        successful exchange only, on bits that are the same in every replica."""
        shared = round_.stacked(batch, SHARED_MOMENTUM_KEY)  # a copy: the old stays
        ns_input = demo.shared_momentum_input_(shared, average, round_.group(batch)["momentum"], round_.group(batch)["nesterov"])
        round_.stage(batch, SHARED_MOMENTUM_KEY, shared)
        return ns_input

    def settle(self, s: int, r: int, engine: ExchangeEngine) -> None:
        """Round r's remaining collectives across replicas, with zeros, if this owner did not get
        to run them with its own payload (after a failure here or earlier in the step)."""
        if not engine.tables[r].owned:
            return
        sizes = self._collective_sizes(engine, r)
        for size in sizes[self.collectives_done.get((s, r), 0) :]:
            dtype = torch.uint8 if self.settings.compressor == "dct" else torch.float32
            self._collective(s, r, engine, torch.zeros(size, dtype=dtype, device=engine.device))

    def _collective(self, s: int, r: int, engine: ExchangeEngine, send: Tensor) -> Tensor:
        """Round r's next collective over the replicas: the all-gather of DCT payloads (bytes,
        returns (R, bytes)), or an average of low-rank factors (all-reduce of fp32, SUM then ÷R:
        gloo has no AVG; every replica gets the same bits of the sum)."""
        done = self.collectives_done.get((s, r), 0)
        self.collectives_done[(s, r)] = done + 1
        if done == 0:
            self.dense_bytes += sum(demo.dense_bytes(*engine.units[u].shape) for u in engine.tables[r].owned)
        if self.settings.compressor == "dct":
            self.payload_sent += (self.count - 1) * send.numel()
            return self.transport.all_gather(send)
        self.allreduced_bytes += send.numel() * send.element_size()
        return self.transport.all_reduce(send).div_(self.count)

    def _collective_sizes(self, engine: ExchangeEngine, r: int) -> list[int]:
        """The sizes of round r's collectives on this owner, the same in every replica: DCT, one
        payload of every batch's fp32 values, then every batch's indices (bytes; values start
        4-byte aligned); low_rank, every right factor Q_r, then every left factor P_r (fp32 elements)."""
        s, shapes = self.settings, [engine.units[u].shape for u in engine.tables[r].owned]
        if s.compressor == "dct":
            return [sum(demo.payload_bytes(rows, cols, s.chunk, s.topk) for rows, cols in shapes)]
        ranks = [low_rank.effective_rank(rows, cols, s.rank) for rows, cols in shapes]
        return [sum(cols * k for (_, cols), k in zip(shapes, ranks)), sum(rows * k for (rows, _), k in zip(shapes, ranks))]

    @staticmethod
    def _offsets(values: list[Tensor], indices: list[Tensor]) -> list[tuple[int, int]]:
        """Byte offsets of each batch's values and indices in a packed payload."""
        value_start, index_start = 0, sum(v.numel() * 4 for v in values)
        offsets = []
        for v, i in zip(values, indices):
            offsets.append((value_start, index_start))
            value_start += v.numel() * 4
            index_start += i.numel() * i.element_size()
        return offsets

    @staticmethod
    def _pack(values: list[Tensor], indices: list[Tensor], size: int) -> Tensor:
        """One byte buffer: every batch's values, then every batch's indices."""
        parts = [v.reshape(-1).view(torch.uint8) for v in values] + [i.reshape(-1).view(torch.uint8) for i in indices]
        send = torch.cat(parts)
        if send.numel() != size:
            raise RuntimeError(f"DeMo payload of {send.numel()} bytes, expected {size} from the plan")
        return send

    # ------------------------------------------------------------ AdamW groups

    def compresses(self, p: Tensor) -> bool:
        """Whether AdamW parameter `p`'s gradient is sign-compressed (``demo_adamw="sign"``, two
        dimensions or more) rather than averaged densely."""
        return self.settings.adamw == "sign" and sign.compressed(tuple(p.shape))

    def new_adamw_state(self, p: Tensor) -> dict[str, Tensor]:
        """The AdamW state DeMo adds to `p`'s: the replica's own error-feedback buffer (fp32,
        laid out like `p`) when its gradient is sign-compressed."""
        return {sign.ERROR_KEY: torch.zeros_like(p, dtype=torch.float32)} if self.compresses(p) else {}

    def check_adamw_layout(self, param_groups: list[dict], name_of) -> None:
        """Sign compression scales whole rows: refuse (naming the option) a compressed AdamW
        parameter whose last dimension is split between ranks (tensor-parallel column shards)."""
        for gi, group in enumerate(param_groups):
            if group["use_muon"]:
                continue
            for pi, p in enumerate(group["params"]):
                if self.compresses(p) and isinstance(p, DTensor) and any(isinstance(pl, Shard) and pl.dim in (-1, p.ndim - 1) for pl in p.placements):
                    raise ValueError(
                        f"titan_muon.Muon: demo_adamw='sign' scales whole rows of each AdamW gradient, but {name_of(gi, pi)!r} is "
                        f"sharded along its last dimension ({p.placements}); use demo_adamw='dense'"
                    )

    def average_adamw_gradients(self, param_groups: list[dict], state: dict, failure: StepFailure, work) -> None:
        """Replace the AdamW groups' (local) gradients by the replicas' average, in place: dense
        ones by an all-reduce per gradient dtype (SUM then 1/R: gloo has no AVG), sign-compressed
        ones by one all-gather of every payload (:meth:`_average_signs`)."""
        by_dtype: dict[torch.dtype, list[Tensor]] = {}
        compressed: list[Tensor] = []
        for group in param_groups:
            if not group["use_muon"]:
                for p in group["params"]:
                    if p.grad is None or not local_shard(p.grad).numel():
                        continue
                    if self.compresses(p):
                        compressed.append(p)
                    else:
                        by_dtype.setdefault(p.grad.dtype, []).append(local_shard(p.grad))
        for grads in by_dtype.values():
            flat = self.transport.all_reduce(torch.cat([g.reshape(-1) for g in grads]))
            flat.div_(self.count)
            torch._foreach_copy_(grads, [part.view_as(g) for part, g in zip(flat.split([g.numel() for g in grads]), grads)])
            self.adamw_bytes += flat.numel() * flat.element_size()
        self.adamw_dense_bytes = 4 * sum(g.numel() for grads in by_dtype.values() for g in grads)
        if compressed:
            self.adamw_dense_bytes += 4 * sum(local_shard(p.grad).numel() for p in compressed)
            self._average_signs(compressed, state, failure, work)

    def _average_signs(self, params: list[Tensor], state: dict, failure: StepFailure, work) -> None:
        """demo/sign.py on every compressed AdamW gradient of this rank: one all-gather over the
        replicas of all scales (fp32), then all bits (padded to a multiple of 4 bytes, so that every
        replica's scales start 4-byte aligned), each replica's average decoded in replica order, the
        new error-feedback buffers staged for the commit. A failure here is recorded in `failure`
        after this rank has still joined the all-gather (with zeros), so no replica waits."""
        shapes = [tuple(sign.rows_of(local_shard(p.grad)).shape) for p in params]
        scale_bytes = sum(4 * rows for rows, _ in shapes)
        bit_sizes = [sign.bits_bytes(rows * cols) for rows, cols in shapes]
        size = scale_bytes + sum(bit_sizes)
        size += -size % 4
        inputs: list[Tensor] = []
        send = None
        if failure.error is None:
            try:
                scales, bits = [], []
                for p in params:
                    x = sign.rows_of(local_shard(state[p][sign.ERROR_KEY])) + sign.rows_of(local_shard(p.grad)).float()
                    work.memory.add(x.numel() * 4)
                    s, b = sign.compress(x)
                    inputs.append(x)
                    scales.append(s)
                    bits.append(b)
                send = torch.cat([s.view(torch.uint8) for s in scales] + bits)
                send = torch.nn.functional.pad(send, (0, size - send.numel()))
            except Exception as error:  # noqa: BLE001 - settled on every rank in agree_on_success
                failure.record(error, "compressing the AdamW gradients")
        if send is None:
            send = torch.zeros(size, dtype=torch.uint8, device=self.transport.device)
        gathered = self.transport.all_gather(send)  # (R, size); every row starts at a multiple of 4 bytes
        self.adamw_sent += (self.count - 1) * size
        if failure.error is not None:
            return
        try:
            replica_scales = [row[:scale_bytes].view(torch.float32).split([rows for rows, _ in shapes]) for row in gathered]
            replica_bits = [row[scale_bytes : scale_bytes + sum(bit_sizes)].split(bit_sizes) for row in gathered]
            mine = self.transport.rank
            for i, (p, x, shape) in enumerate(zip(params, inputs, shapes)):
                grad = local_shard(p.grad)
                average = sign.average_decoded([s[i] for s in replica_scales], [b[i] for b in replica_bits], shape)
                error = x.sub_(sign.decode(replica_scales[mine][i], replica_bits[mine][i], shape))  # x − own decode
                work.staged.append((state[p], {sign.ERROR_KEY: _like(state[p][sign.ERROR_KEY], error.view(grad.shape))}))
                grad.copy_(average.view(grad.shape))
        except Exception as error:  # noqa: BLE001 - settled on every rank in agree_on_success
            failure.record(error, "averaging the AdamW gradients")

    # ------------------------------------------------------------ checkpoints

    def stacked(self, state: Tensor, param: Tensor) -> DTensor:
        """A replica's state tensor laid out like `param` as its slice of an (R, *shape) DTensor:
        ``Shard(0)`` over the replicas and the parameter's placements on the other dims, so DCP
        saves every replica's own momentum (a replicated tensor it would save once)."""
        if isinstance(param, DTensor):
            mesh = self._mesh(param.device_mesh)
            placements = (Shard(0), *(_shifted(p, param) for p in state.placements))
        else:
            mesh, placements = self._mesh(None), (Shard(0),)
        shape = (self.count, *state.shape)
        stride = tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))  # contiguous
        return DTensor.from_local(local_shard(state).unsqueeze(0), mesh, placements, shape=torch.Size(shape), stride=stride)

    def own_slice(self, stacked: Tensor, param: Tensor, name: str) -> Tensor:
        """This replica's state laid out like `param`, from a loaded :meth:`stacked` tensor."""
        if not isinstance(stacked, DTensor) or stacked.ndim != param.ndim + 1 or stacked.shape[1:] != param.shape:
            raise ValueError(
                f"titan_muon.Muon: the saved Muon state of {name!r} has shape {tuple(stacked.shape)}; with demo=True it "
                f"is ({self.count}, {', '.join(map(str, param.shape))}): one momentum per replica (was it saved without demo?)"
            )
        if stacked.shape[0] != self.count:
            raise ValueError(
                f"titan_muon.Muon: the checkpoint holds the momenta of {stacked.shape[0]} replicas, this run has "
                f"{self.count}: with demo=True every replica keeps its own momentum, and a changed number of "
                "replicas has no exact meaning (whose momentum would a new replica take?). Resume with the same "
                "data_parallel_replicate degree, or load the weights only."
            )
        local = stacked.to_local()[0]
        if isinstance(param, DTensor):
            return DTensor.from_local(local, param.device_mesh, param.placements, shape=param.shape, stride=param.stride())
        return local

    def _mesh(self, param_mesh: DeviceMesh | None) -> DeviceMesh:
        """(replicas, *param_mesh's dims), its layout gathered over the replicas once."""
        key = None if param_mesh is None else (tuple(param_mesh.mesh.reshape(-1).tolist()), param_mesh.mesh_dim_names)
        if key not in self._meshes:
            device_type = self.transport.device.type
            if param_mesh is None:
                self._meshes[key] = DeviceMesh.from_group(self.transport.group, device_type, mesh_dim_names=("demo_replica",))
            else:
                ranks = param_mesh.mesh.to(device=self.transport.device, dtype=torch.int64).reshape(-1)
                layout = self.transport.all_gather(ranks).cpu().reshape(self.count, *param_mesh.mesh.shape)
                groups = [self.transport.group, *(param_mesh.get_group(d) for d in range(param_mesh.ndim))]
                names = param_mesh.mesh_dim_names or tuple(f"dim{d}" for d in range(param_mesh.ndim))
                self._meshes[key] = DeviceMesh.from_group(groups, device_type, mesh=layout, mesh_dim_names=("demo_replica", *names))
        return self._meshes[key]

    # ------------------------------------------------------------ metrics

    def metrics(self) -> dict[str, float]:
        """This rank's bytes across replicas per step, ring wire model (docs/demo.md "Bytes"):
        ``demo/bytes_sent``, the Muon matrices it owns: all-gathers of DCT payloads ((R − 1) ×
        payload) or all-reduces of low-rank factors (2(R − 1)/R × bytes); ``demo/bytes_dense``, a
        ring all-reduce of the same matrices' fp32 gradients; ``demo/adamw_bytes_sent``, its AdamW
        gradients: the dense ones' all-reduce plus the sign payloads' all-gather; the totals
        ``demo/total_bytes_sent`` (the two sent) and ``demo/total_bytes_dense`` (what a dense fp32
        all-reduce of every gradient of this rank would send: HSDP's full sync)."""
        muon = self.payload_sent + demo.allreduce_bytes_sent(self.allreduced_bytes, self.count)
        adamw = demo.allreduce_bytes_sent(self.adamw_bytes, self.count) + self.adamw_sent
        dense = demo.allreduce_bytes_sent(self.dense_bytes, self.count)
        return {
            "demo/bytes_sent": float(muon),
            "demo/bytes_dense": float(dense),
            "demo/adamw_bytes_sent": float(adamw),
            "demo/total_bytes_sent": float(muon + adamw),
            "demo/total_bytes_dense": float(dense + demo.allreduce_bytes_sent(self.adamw_dense_bytes, self.count)),
        }


def _like(reference: Tensor, local: Tensor) -> Tensor:
    """`local` as a tensor laid out like `reference` (a DTensor's local block, or plain)."""
    if isinstance(reference, DTensor):
        return DTensor.from_local(local, reference.device_mesh, reference.placements, shape=reference.shape, stride=reference.stride())
    return local


def _shifted(placement, param: Tensor):
    if isinstance(placement, Replicate):
        return placement
    if type(placement) is Shard:
        return Shard(placement.dim + 1)
    raise NotImplementedError(f"titan_muon.Muon: checkpoints with demo=True support Shard/Replicate placements, got {placement} for a parameter of shape {tuple(param.shape)}")
