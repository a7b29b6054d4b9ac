"""One step's work on the Muon matrices: what travels, what owners compute, where updates go.

Between the gradient agreement and the commit, every rank set's exchange engine (exchange.py)
runs its rounds and calls back into a :class:`MatrixStep`, which holds everything the step's
matrix work needs:

* ``fill`` — what a piece carries to its owner: the Nesterov input g + μ(M' − g) made from this
  rank's momentum, written straight into the send buffer in the wire dtype; the raw gradient
  where the owners hold momentum (overlap, DeMo); zeros for a parameter without gradients;
* ``orthogonalize`` — what an owner computes for a round: the input of each batch (as it
  arrived; the owners' own Nesterov input; DeMo's average over the replicas), Newton–Schulz,
  the shape's scale;
* ``receive`` — each returned update, kept for the commit with the block it updates or, with
  ``streaming``, written into that block once its whole round has returned (``write_round``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from titan_muon.step.commit import StepWork, apply_updates, staged_state
from titan_muon.algorithm.newton_schulz import Pieces
from titan_muon.algorithm.orthogonalizer import Orthogonalizer
from titan_muon.algorithm.update import Elementwise, coalesce
from titan_muon.buffers import Buffers, cut_bytes
from titan_muon.exchange.engine import ExchangeEngine, MemoryAccount, ReturnSlots, StepFailure
from titan_muon.exchange.params import MuonParam
from titan_muon.exchange.plan import Piece, RoundTables, Unit
from titan_muon.exchange.reservation import ReservationStore, ReservedRounds, RoundBytes, largest, reservation_bytes
from titan_muon.exchange.redistribute import Batch, local_piece
from titan_muon.step.agreement import Verdict
from titan_muon.timing import StepTimer, phase


@dataclass
class MatrixStep:
    params: list[MuonParam]  # the optimizer's Muon parameters, by MuonParam.index
    state: dict  # the optimizer's per-parameter state
    owner_blocks: dict  # (rank set, unit) -> whole-matrix momentum on its owner
    storage: object  # state.MomentumStorage
    comm_dtype: torch.dtype
    newton_schulz: Orthogonalizer
    elementwise: Elementwise
    replicas: object | None  # demo_step.Replicas with DeMo
    verdict: Verdict
    failure: StepFailure
    timer: StepTimer
    work: StepWork
    streaming: bool = False  # commit="streaming": weights written round by round
    reserved: ReservedRounds | None = None  # the streaming step's memory, reserved before the verdict
    momenta: dict[int, Tensor] = field(default_factory=dict)  # decoded low-precision momentum, once per parameter
    scratch: MemoryAccount = field(default_factory=MemoryAccount)

    @property
    def memory(self) -> MemoryAccount:
        """Where buffers are counted: the step's account, or, when they are cut from the reservation
        (counted whole when it was made), a scratch account."""
        return self.scratch if self.reserved is not None else self.work.memory

    def run(self, engines: list[ExchangeEngine]) -> None:
        """Every rank set's rounds; last, the matrices this rank holds whole (a one-rank exchange)."""
        for s, engine in enumerate(engines):
            early = self.verdict.early[s]
            scales = early.scales if early is not None else {}
            if self.reserved is not None:
                self.reserved.next_engine()
            self.work.held += engine.run(
                dtype=torch.float32 if engine.owners_hold_momentum else self.comm_dtype, return_dtype=self.comm_dtype,
                fill=lambda pairs, engine=engine: self.fill(engine, pairs),
                receive=lambda r, piece, update, engine=engine: self.receive(engine, piece, update),
                failure=self.failure, memory=self.memory, rounds=self.reserved,
                orthogonalize=lambda r, batches, buffers, returns, s=s, engine=engine: self.orthogonalize(s, engine, r, batches, scales.get(r, {}), buffers, returns),
                key_of=lambda u, engine=engine: self.ns_key(engine.units[u]),
                arrived=early.arrived if early is not None else None,
                settle=(lambda r, s=s, engine=engine: self.replicas.settle(s, r, engine)) if self.replicas is not None else None,
                returned=self.write_round if self.streaming else None,
                in_place=lambda key, engine=engine: reads_arrivals(engine, key, self.newton_schulz, self.comm_dtype, self.replicas is not None),
            )  # fmt: skip

    def ns_key(self, unit: Unit) -> tuple[tuple[int, int], int]:
        return ns_key(self.params, unit)

    # ------------------------------------------------------------------ shard side

    def fill(self, engine: ExchangeEngine, pairs: list[tuple[Piece, Tensor]]) -> None:
        nesterov: dict[int, list[tuple[Tensor, Tensor, Tensor]]] = {}  # per parameter: (slot, gradient block, momentum block)
        for piece, out in pairs:
            entry = self.params[engine.units[piece.unit].param]
            p = entry.param
            if id(p) in self.verdict.skipped:
                out.zero_()
            elif engine.owners_hold_momentum:
                out.copy_(local_piece(entry.stack(p.grad), piece))
            else:
                if entry.index not in self.momenta:
                    self.momenta[entry.index] = entry.stack(self.storage.load(self.state[p]))
                    if self.storage.name != "fp32":  # a decoded copy, held for the rest of the exchange
                        self.memory.add(self.momenta[entry.index].numel() * 4)
                nesterov.setdefault(entry.index, []).append((out, local_piece(entry.stack(p.grad), piece), local_piece(self.momenta[entry.index], piece)))
        writes_momentum = self.streaming and self.storage.name == "fp32"  # no rollback to protect: the commit's lerp is done here
        passes: dict[tuple[float, bool], list[tuple[Tensor, Tensor, Tensor]]] = {}  # per (β, Nesterov): one list of blocks
        for index, blocks in nesterov.items():
            group = self.params[index].group
            passes.setdefault((group["momentum"], group["nesterov"]), []).extend(coalesce(blocks))  # adjacent blocks (an EP rank's experts): one per run
            if writes_momentum:
                self.work.momentum_written.add(index)
        for (beta, use_nesterov), blocks in passes.items():
            outs, grads, momenta = (list(column) for column in zip(*blocks))
            if writes_momentum:
                self.elementwise.momenta_and_nesterov_inputs_(momenta, outs, grads, beta, use_nesterov)
            else:
                self.elementwise.nesterov_inputs_into(outs, grads, momenta, beta, use_nesterov)

    def receive(self, engine: ExchangeEngine, piece: Piece, update: Tensor) -> None:
        entry = self.params[engine.units[piece.unit].param]
        if id(entry.param) not in self.verdict.skipped:
            self.work.updates.append((entry, local_piece(entry.stack(entry.param), piece), update))

    def write_round(self, r: int) -> None:
        """commit="streaming": the returned round's updates go into the weights now, and go."""
        with phase("commit_round"):
            apply_updates(self.work.updates, self.elementwise, self.work)
        self.work.updates.clear()

    # ------------------------------------------------------------------ owner side

    def orthogonalize(self, s: int, engine: ExchangeEngine, r: int, batches: list[Batch], scales: dict[int, float],
                      buffers: Buffers, returns: Callable[[], ReturnSlots]) -> tuple[dict[int, Tensor], int]:  # fmt: skip
        """Each batch's scaled updates, written straight into the return buffer's slots (`returns`)
        where Orthogonalizer.writes_blocks (not with DeMo), else returned with the bytes of those results counted
        in the memory account: one result tensor per batch, the input's own memory where the dtypes
        have one size (NS reads its input before writing), else from `buffers`; computed chunk by
        chunk (Orthogonalizer.chunks) with the chunk's workspace from `buffers` too."""
        results: dict[int, Tensor] = {}
        counted = 0
        inputs = self._owner_inputs(s, engine, r, batches, scales)
        # Inputs made here (the owners' Nesterov input, DeMo's) live beside the arrivals until the round's NS is done.
        made = sum(m.numel() * m.element_size() for batch, m in zip(batches, inputs) if m is not batch.matrices)
        self.memory.add(made)
        for batch, matrices in zip(batches, inputs):
            # DeMo keeps whole-matrix math: its owners compute the same bits on every layout (R × S)
            if self.replicas is None and self.newton_schulz.writes_blocks(batch.key, self.comm_dtype):
                self._into_return_buffer(batch, matrices, returns(), buffers)
            else:
                counted += self._into_results(batch, matrices, results, buffers)
        self.memory.free(made)
        return results, counted

    def _into_return_buffer(self, batch: Batch, matrices: Tensor | None, slots: ReturnSlots, buffers: Buffers) -> None:
        """A batch's updates written by NS's last products into the return buffer's slots, one matrix at
        a time; its input read by the pieces it travelled in where reads_pieces (where it arrived,
        `matrices` None, or as views of a matrix made here: one norm, one layout either way)."""
        key, dtype = batch.key, self.newton_schulz.result_dtype(batch.key)
        blocks = [_rectangles(slots[u]) for u in batch.units]
        # the arrivals, once read, hold iterates (inputs made here may be kept: staged momentum)
        reuse = matrices is not None and matrices is batch.matrices and results_replace_arrivals(matrices.dtype, dtype)
        if (matrices is None or matrices is not batch.matrices) and self.newton_schulz.reads_pieces(key, self.comm_dtype):
            matrices = [Pieces(key[0], _rectangles(batch.arrivals[i]) if matrices is None else
                               [(rows, cols, matrices[i, rows[0] : rows[1], cols[0] : cols[1]]) for rows, cols, _ in blocks[i]])
                        for i in range(len(batch.units))]  # fmt: skip
        workspace = self.newton_schulz.workspace_bytes(key, 1, spare=not reuse)
        self.memory.add(workspace)
        self.newton_schulz(key, matrices, self.timer, self.work, out=blocks, buffers=buffers, spare=matrices.view(dtype) if reuse else None)
        self.memory.free(workspace)

    def _into_results(self, batch: Batch, matrices: Tensor, results: dict[int, Tensor], buffers: Buffers) -> int:
        """A batch's updates as one result tensor (added to `results` per unit), chunk by chunk; the
        bytes counted for it (none where it takes the arrivals' place)."""
        dtype = self.newton_schulz.result_dtype(batch.key)
        in_place = matrices is batch.matrices and results_replace_arrivals(matrices.dtype, dtype)
        out = matrices.view(dtype) if in_place else buffers.take(matrices.shape, dtype)
        counted = 0 if in_place else out.numel() * out.element_size()
        self.memory.add(counted)  # until the return buffer is packed
        for chunk in self.newton_schulz.chunks(batch.key, len(matrices)):
            workspace = self.newton_schulz.workspace_bytes(batch.key, chunk.stop - chunk.start)
            self.memory.add(workspace)
            self.newton_schulz(batch.key, matrices[chunk], self.timer, self.work, out=out[chunk], buffers=buffers)
            self.memory.free(workspace)
        results.update(zip(batch.units, out.unbind(0)))
        return counted

    def _owner_inputs(self, s: int, engine: ExchangeEngine, r: int, batches: list[Batch], scales: dict[int, float]) -> list[Tensor]:
        """What Newton–Schulz gets for each batch: DeMo's average of the replicas' compressed
        momentum, the owners' Nesterov input, or (momentum on the shards) the matrices as they arrived."""
        if self.replicas is not None:
            with phase("demo"):
                return self.replicas.round_inputs(s, r, engine, batches, self.owner_blocks, self.params, self.verdict.skipped,
                                                  self.storage, self.work)  # fmt: skip
        if engine.owners_hold_momentum:
            with phase("owner_momentum"):
                return [self._owner_nesterov(s, engine, b.units, b.matrices, scales) for b in batches]
        return [b.matrices for b in batches]

    def _owner_nesterov(self, s: int, engine: ExchangeEngine, units: list[int], gradients: Tensor, scales: dict[int, float]) -> Tensor:
        """With momentum on the owners: M' = μM + (1−μ)·c·g on whole matrices (staged for the
        commit) and the Nesterov input, rounded to the wire dtype as the shard-side path sends
        it. c undoes what happened to the gradient after it was sent during backward (gradient
        clipping), 1 if sent in step(). A matrix without gradients keeps its momentum."""
        out = torch.empty_like(gradients)
        # One pass over the batch (one shape of one param group: one β, one Nesterov), which cuts
        # it into compiled lists itself; momentum decoded from bf16/fp8 storage is a copy, so
        # there each block goes alone and its copy is dropped before the next is decoded.
        one_at_a_time = self.storage.name != "fp32"
        pending: list[tuple[Tensor, Tensor, Tensor, int]] = []
        group = self.params[engine.units[units[0]].param].group if units else None

        def flush() -> None:
            slots, grads, momenta, held = (list(column) for column in zip(*pending))
            news = self.elementwise.nesterov_inputs_and_momenta_into(slots, grads, momenta, group["momentum"], group["nesterov"])
            for u, new in zip(held, news):
                unit, state = engine.units[u], self.owner_blocks[(s, u)]
                first_row = unit.matrix * self.params[unit.param].param.shape[-2] + unit.row_start
                self.work.staged.append((state, staged_state(self.storage, state, new, unit.param, first_row, self.work.memory)))
            pending.clear()

        for u, grad, slot in zip(units, gradients.unbind(0), out.unbind(0)):
            unit = engine.units[u]
            entry = self.params[unit.param]
            if id(entry.param) in self.verdict.skipped:
                slot.zero_()
                continue
            c = scales.get(unit.param, 1.0)
            if c != 1.0:
                grad.mul_(c)  # `gradients` is this batch's own assembled copy
            pending.append((slot, grad, self.storage.load(self.owner_blocks[(s, u)]), u))
            if one_at_a_time:
                flush()
        if pending:
            flush()
        return out.to(self.comm_dtype).float() if self.comm_dtype != torch.float32 else out



def _rectangles(pieces: list[tuple[Piece, Tensor]]) -> list[tuple[tuple[int, int], tuple[int, int], Tensor]]:
    """(piece, view) pairs as newton_schulz's rectangles of their matrix (Blocks, Pieces.blocks)."""
    return [(piece.rows, piece.cols, view) for piece, view in pieces]


def reads_arrivals(engine: ExchangeEngine, key: tuple, newton_schulz: Orthogonalizer, wire: torch.dtype, demo: bool) -> bool:
    """Whether the owner reads `key`'s matrices as Pieces where they arrived, never assembling them:
    where Orthogonalizer.reads_pieces, its input is what arrived (not the owners' own Nesterov
    input, not DeMo's) and it arrived from other ranks (a one-rank exchange lands in its send
    buffer, which the next rounds reuse before this round's NS)."""
    return engine.sharded and not engine.owners_hold_momentum and not demo and newton_schulz.reads_pieces(key, wire)


def results_replace_arrivals(arrival: torch.dtype, result: torch.dtype) -> bool:
    """Whether an owner's NS results are written over the batch that arrived (NS reads its input
    before writing): where the two dtypes have one size. MatrixStep.orthogonalize cuts the results
    by it and owner_bytes sizes the reservation by it."""
    return arrival.itemsize == result.itemsize


def ns_key(params: list[MuonParam], unit: Unit) -> tuple[tuple[int, int], int]:
    """Matrices batch together when they have one shape and one param group's settings."""
    return (unit.shape, params[unit.param].group_index)


def owner_bytes(engine: ExchangeEngine, tables: RoundTables, wire: torch.dtype, params: list[MuonParam],
                newton_schulz: Orthogonalizer) -> int:  # fmt: skip
    """What MatrixStep.orthogonalize and the assembly before it cut from a round's owner area:
    each batch as it arrived, its results where they are neither written into the return buffer
    nor can take its place, and the largest chunk's workspace (reservation.py).
    Only for matrices whose momentum lives on the shards (the owners make no inputs)."""
    counts: dict[tuple, int] = {}
    for u in tables.owned:
        key = ns_key(params, engine.units[u])
        counts[key] = counts.get(key, 0) + 1
    total, workspace = 0, 0
    for key, count in counts.items():
        (rows, cols), dtype = key[0], newton_schulz.result_dtype(key)
        if reads_arrivals(engine, key, newton_schulz, wire, False):  # read where they arrived, results in the return buffer
            workspace = max(workspace, newton_schulz.workspace_bytes(key, 1, reserved=True, spare=True))
            continue
        total += cut_bytes((count, rows, cols), wire)
        if newton_schulz.writes_blocks(key, wire):  # results in the return buffer, one matrix at a time, iterating in the arrival
            workspace = max(workspace, newton_schulz.workspace_bytes(key, 1, reserved=True))
            continue
        total += 0 if results_replace_arrivals(wire, dtype) else cut_bytes((count, rows, cols), dtype)
        for chunk in newton_schulz.chunks(key, count):
            workspace = max(workspace, newton_schulz.workspace_bytes(key, chunk.stop - chunk.start, reserved=True))
    return total + workspace


def reserve_rounds(engines: list[ExchangeEngine], params: list[MuonParam], newton_schulz: Orthogonalizer, wire: torch.dtype,
                   store: ReservationStore, memory: MemoryAccount) -> tuple[ReservedRounds | None, str | None]:  # fmt: skip
    """The memory of a streaming step whose momentum lives on the shards, reserved whole: one byte
    tensor from `store` holding every engine's largest round in each region (reservation.py),
    counted in `memory`; or (None, why) if it cannot be allocated. Made before the step's first
    agreement, which carries the failure to every rank before anything is written."""
    def layout() -> tuple[RoundBytes, int, bool, int]:
        rounds = [engine.round_bytes(r, wire, wire, lambda tables, engine=engine: owner_bytes(engine, tables, wire, params, newton_schulz))
                  for engine in engines for r in range(len(engine.tables))]  # fmt: skip
        held = any(reads_arrivals(engine, ns_key(params, engine.units[u]), newton_schulz, wire, False)
                   for engine in engines for u in engine.owned_units())  # fmt: skip
        most_rounds = max(len(engine.tables) for engine in engines)
        return largest(rounds), max(engine.rounds_in_flight for engine in engines), held, most_rounds

    # beyond the exchange plan (the store's own), the sizes depend on the wire and the NS plans
    sizes, in_flight, arrivals_held, most_rounds = store.layout((wire, newton_schulz.plan_settings()), layout)
    nbytes = reservation_bytes(sizes, in_flight, arrivals_held, most_rounds)
    try:
        storage = store.take(nbytes)
    except Exception as error:  # noqa: BLE001 - every rank raises in the verdict
        return None, f"{nbytes} bytes: {type(error).__name__}: {error}"
    memory.add(nbytes)
    memory.kept = store.kept_bytes
    return ReservedRounds(storage, sizes, in_flight, arrivals_held, most_rounds), None
