"""Moving pieces between local shards and whole matrices, following a rank's RoundTables.

Pure tensor functions (no torch.distributed), used by ``step()``, the backward-overlap hooks
and checkpoint conversion alike, and driven by tests with several simulated ranks in one
process. A round trip, on every rank::

    send = buffer of send_numel; for piece, slot in outbound_slots(tables, send): slot.copy_(my piece)
    received = all_to_all(send, tables.send_counts, tables.recv_counts)
    batches = assemble(tables, received, ...)                   # whole matrices I own (in_place: their pieces)
    back = disassemble(tables, results)                         # ordered by source
    # (or: NS writes each result's pieces into unit_slots(tables, back) as it makes them)
    mine = all_to_all(back, tables.recv_counts, tables.send_counts)
    for piece, update in outbound_slots(tables, mine): ...      # one view per outbound piece

The tables are walked in exactly two ways — :func:`outbound_slots` (the pieces this rank
holds, ordered by owner) and :func:`inbound_slots` (the pieces of the units it owns, ordered
by source rank) — and everything else is built on them. A ``column_map`` moves a walk to a
state tensor whose columns are not the parameter's (fp8 momentum's per-block exponents).
Each function costs a constant number of tensor ops per piece or per batch, no host reads.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from titan_muon.buffers import Buffers, FreshBuffers
from titan_muon.exchange.plan import Piece, RoundTables, Unit

ColumnMap = Callable[[Piece], tuple[int, int]]  # a piece's columns in the walked tensor


def piece_columns(piece: Piece) -> tuple[int, int]:
    return piece.cols


def _slots(pieces: Sequence[Piece], buffer: Tensor, column_map: ColumnMap) -> Iterator[tuple[Piece, Tensor]]:
    offset = 0
    for piece in pieces:
        lo, hi = column_map(piece)
        shape = (piece.rows[1] - piece.rows[0], hi - lo)
        size = shape[0] * shape[1]
        yield piece, buffer[offset : offset + size].view(shape)
        offset += size


def outbound_slots(tables: RoundTables, buffer: Tensor, column_map: ColumnMap = piece_columns) -> Iterator[tuple[Piece, Tensor]]:
    """(piece, (rows, cols) view of `buffer`) for each piece this rank holds, in send order."""
    return _slots(tables.outbound, buffer, column_map)


def inbound_slots(tables: RoundTables, buffer: Tensor, column_map: ColumnMap = piece_columns) -> Iterator[tuple[Piece, Tensor]]:
    """(piece, (rows, cols) view of `buffer`) for each piece of the units this rank owns, by source rank."""
    return _slots(tables.inbound, buffer, column_map)


def split_counts(pieces: Sequence[Piece], world: int, column_map: ColumnMap = piece_columns) -> tuple[int, ...]:
    """Elements per peer of `pieces` under `column_map` (the tables' own counts for the identity)."""
    counts = [0] * world
    for piece in pieces:
        lo, hi = column_map(piece)
        counts[piece.peer] += (piece.rows[1] - piece.rows[0]) * (hi - lo)
    return tuple(counts)


def local_piece(stack: Tensor, piece: Piece) -> Tensor:
    """An outbound piece's rows of this rank's local (matrices, rows, cols) stack."""
    m, r0, r1 = piece.local
    return stack[m, r0:r1]


def pack(parts: Sequence[Tensor], dtype: torch.dtype, buffers: Buffers) -> Tensor:
    """One flat buffer from `buffers` holding `parts` back to back, in `dtype`."""
    flat = [p.reshape(-1) for p in parts]
    out = buffers.take((sum(p.numel() for p in flat),), dtype)
    return torch.cat(flat, out=out) if flat else out


@dataclass
class Batch:
    """Whole matrices of equal shape and settings, ready for one batched Newton–Schulz."""

    key: Hashable
    units: list[int]
    matrices: Tensor | None  # (len(units), rows, cols); None where they are read where they arrived
    arrivals: list[list[tuple[Piece, Tensor]]] | None = None  # then, per unit, its pieces (unit_slots) in the receive buffer


def assemble(
    tables: RoundTables,
    received: Tensor,
    units: Sequence[Unit],
    key_of: Callable[[int], Hashable],
    buffers: Buffers | None = None,
    in_place: Callable[[Hashable], bool] | None = None,
) -> list[Batch]:
    """The whole matrices of the units this rank owns in the round, grouped by `key_of(unit)`,
    in the dtype they travelled in (Newton–Schulz reads them as they are: a bf16 wire feeds bf16
    NS without a conversion pass).

    `received` is the round's inbound buffer. Units whose pieces all span full rows (FSDP /
    expert sharding) are stacked with one ``torch.cat`` per batch; pieces that cover only some
    columns (tensor parallel) are copied into place. The batches come from `buffers` (default: allocated).
    Keys for which ``in_place(key)`` holds are not copied: their batches list each unit's pieces in
    `received` instead (which must then stay alive until they are read).
    """
    views = unit_slots(tables, received)
    groups: dict[Hashable, list[int]] = defaultdict(list)
    for u in tables.owned:
        groups[key_of(u)].append(u)

    buffers = buffers if buffers is not None else FreshBuffers(received.device)
    batches = []
    for key, members in groups.items():
        if in_place is not None and in_place(key):
            batches.append(Batch(key, members, None, [views[u] for u in members]))
            continue
        rows, cols = units[members[0]].shape
        ordered = [pv for u in members for pv in views[u]]
        matrices = buffers.take((len(members), rows, cols), received.dtype)
        if all(piece.cols == (0, cols) for piece, _ in ordered):
            torch.cat([v for _, v in ordered], out=matrices.view(-1, cols))
        else:
            slot = {u: i for i, u in enumerate(members)}
            for piece, view in ordered:
                matrices[slot[piece.unit], piece.rows[0] : piece.rows[1], piece.cols[0] : piece.cols[1]] = view
        batches.append(Batch(key, members, matrices))
    return batches


def unit_slots(tables: RoundTables, buffer: Tensor) -> dict[int, list[tuple[Piece, Tensor]]]:
    """Per unit this rank owns in the round, its (piece, view of `buffer`) in inbound layout,
    ordered by (first row, first column)."""
    slots: dict[int, list[tuple[Piece, Tensor]]] = defaultdict(list)
    for piece, view in inbound_slots(tables, buffer):
        slots[piece.unit].append((piece, view))
    for pieces in slots.values():
        pieces.sort(key=lambda pv: (pv[0].rows[0], pv[0].cols[0]))
    return slots


def disassemble(tables: RoundTables, results: dict[int, Tensor], dtype: torch.dtype, buffers: Buffers) -> Tensor:
    """The return buffer, from `buffers`: each source rank's pieces of the owned units' results, in inbound order."""
    parts = [results[p.unit][p.rows[0] : p.rows[1], p.cols[0] : p.cols[1]] for p in tables.inbound]
    return pack(parts, dtype, buffers)  # one concatenation in inbound (slot) order


def disassemble_into(slots: dict[int, list[tuple[Piece, Tensor]]], results: dict[int, Tensor]) -> None:
    """`results` copied piece by piece into their slots of a return buffer (unit_slots) whose other
    units' pieces were written already (Newton–Schulz's last products, writing into blocks)."""
    for u, result in results.items():
        for piece, view in slots[u]:
            view.copy_(result[piece.rows[0] : piece.rows[1], piece.cols[0] : piece.cols[1]])
