"""Moving pieces between local shards and whole matrices, following a rank's BucketSchedule.

Pure tensor functions (no torch.distributed): ``step()`` and the backward-overlap hooks both
use them, and tests drive them with several simulated ranks in one process. A bucket's
round trip, on every rank::

    send = pack(views of my outbound pieces)                        # ordered by owner
    received = all_to_all(send, schedule.send_counts, schedule.recv_counts)
    batches = assemble(schedule, received, ...)                     # whole matrices I own
    back = disassemble(schedule, results)                           # ordered by source
    mine = all_to_all(back, schedule.recv_counts, schedule.send_counts)
    updates = unpack(schedule, mine)                                # one view per outbound piece

Each function costs a constant number of tensor ops per piece or per batch, no host reads.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from titan_muon.plan import BucketSchedule, Piece, Unit


def local_views(pieces: Sequence[Piece], stack_of: Callable[[Piece], Tensor]) -> list[Tensor]:
    """Each outbound piece as a (rows, local cols) view of its parameter's local (matrices, rows, cols) stack."""
    return [stack_of(p)[p.local[0], p.local[1] : p.local[2]] for p in pieces]


def pack(parts: Sequence[Tensor], dtype: torch.dtype, device: torch.device) -> Tensor:
    """One flat send buffer holding `parts` back to back, in `dtype`."""
    if not parts:
        return torch.empty(0, dtype=dtype, device=device)
    flat = [p.reshape(-1) for p in parts]
    if all(p.dtype == dtype for p in flat):
        return torch.cat(flat)
    out = torch.empty(sum(p.numel() for p in flat), dtype=dtype, device=device)
    return torch.cat(flat, out=out)


@dataclass
class Batch:
    """Whole matrices of equal shape and settings, ready for one batched Newton–Schulz."""

    key: Hashable
    units: list[int]
    matrices: Tensor  # (len(units), rows, cols)


def assemble(
    schedule: BucketSchedule,
    received: Tensor,
    units: Sequence[Unit],
    key_of: Callable[[int], Hashable],
    dtype: torch.dtype = torch.float32,
) -> list[Batch]:
    """The whole matrices of the units this rank owns in the bucket, grouped by `key_of(unit)`.

    `received` is the bucket's inbound buffer (pieces ordered by source rank). Units whose
    pieces all span full rows (FSDP / expert sharding) are stacked with one ``torch.cat`` per
    batch; pieces that cover only some columns (tensor parallel) are copied into place.
    """
    pieces_of: dict[int, list[Piece]] = defaultdict(list)
    for piece in schedule.inbound:
        pieces_of[piece.unit].append(piece)
    groups: dict[Hashable, list[int]] = defaultdict(list)
    for u in schedule.owned:
        groups[key_of(u)].append(u)

    batches = []
    for key, members in groups.items():
        rows, cols = units[members[0]].shape
        views = [
            (piece, received[piece.offset : piece.offset + piece.numel].view(piece.shape))
            for u in members
            for piece in sorted(pieces_of[u], key=lambda p: (p.rows[0], p.cols[0]))
        ]
        if all(piece.cols == (0, cols) for piece, _ in views):
            matrices = torch.cat([v for _, v in views]).to(dtype).view(len(members), rows, cols)
        else:
            matrices = torch.empty(len(members), rows, cols, dtype=dtype, device=received.device)
            slot = {u: i for i, u in enumerate(members)}
            for piece, view in views:
                matrices[slot[piece.unit], piece.rows[0] : piece.rows[1], piece.cols[0] : piece.cols[1]] = view
        batches.append(Batch(key, members, matrices))
    return batches


def disassemble(schedule: BucketSchedule, results: dict[int, Tensor], dtype: torch.dtype, device: torch.device) -> Tensor:
    """The return buffer: each source rank's pieces of the owned units' results, in inbound order."""
    parts = [results[p.unit][p.rows[0] : p.rows[1], p.cols[0] : p.cols[1]] for p in schedule.inbound]
    return pack(parts, dtype, device)


def unpack(schedule: BucketSchedule, received: Tensor) -> list[Tensor]:
    """One (rows, cols) view per outbound piece of the bucket's returned buffer."""
    return [received[p.offset : p.offset + p.numel].view(p.shape) for p in schedule.outbound]
