"""Who orthogonalizes what: a pure function of global shapes and the world size.

FSDP2 shards each parameter along dim 0 like ``torch.chunk``: rank r holds a contiguous row
range, trailing ranks may hold nothing. Newton–Schulz needs whole matrices, so every matrix
("unit": a whole parameter, or a row block of one when attention heads are split) gets one
owner rank. Units are packed into buckets; for each bucket every rank sends the rows it holds
to the owners with one ``all_to_all_single``, owners orthogonalize, and a second
``all_to_all_single`` with the mirrored split sizes brings each rank its rows back.

Nothing here touches torch.distributed: every rank computes the same plan from the same
inputs, and the optimizer checks that once with a fingerprint.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from titan_muon.newton_schulz import newton_schulz_flops


def shard_rows(num_rows: int, world_size: int) -> list[tuple[int, int]]:
    """Row range [start, end) each rank holds under FSDP2 / DTensor ``Shard(0)`` (torch.chunk split)."""
    chunk = -(-num_rows // world_size)  # ceil division
    return [(min(r * chunk, num_rows), min((r + 1) * chunk, num_rows)) for r in range(world_size)]


@dataclass(frozen=True)
class Unit:
    """One matrix for Newton–Schulz: rows [row_start, row_end) of sharded parameter `param`."""

    param: int
    row_start: int
    row_end: int
    cols: int
    param_rows: int

    @property
    def rows(self) -> int:
        return self.row_end - self.row_start

    @property
    def numel(self) -> int:
        return self.rows * self.cols

    def rows_on(self, rank: int, world_size: int) -> tuple[int, int]:
        """The unit's rows held by `rank`, as offsets into the unit ([0, rows)); possibly empty."""
        shard_start, shard_end = shard_rows(self.param_rows, world_size)[rank]
        start = min(max(shard_start, self.row_start), self.row_end)
        end = max(start, min(shard_end, self.row_end))
        return start - self.row_start, end - self.row_start

    def rows_in_shard(self, rank: int, world_size: int) -> tuple[int, int]:
        """The same rows as offsets into `rank`'s local shard of the parameter."""
        lo, hi = self.rows_on(rank, world_size)
        shard_start = shard_rows(self.param_rows, world_size)[rank][0]
        return lo + self.row_start - shard_start, hi + self.row_start - shard_start

    def numel_on(self, rank: int, world_size: int) -> int:
        start, end = self.rows_on(rank, world_size)
        return (end - start) * self.cols


@dataclass(frozen=True)
class Plan:
    world_size: int
    units: tuple[Unit, ...]
    owners: tuple[int, ...]  # owner rank of each unit
    buckets: tuple[tuple[int, ...], ...]  # unit indices, in communication order

    def owned_units(self, bucket: int, rank: int) -> list[int]:
        return [u for u in self.buckets[bucket] if self.owners[u] == rank]

    def send_counts(self, bucket: int, rank: int) -> list[int]:
        """Elements `rank` sends to each owner in the bucket's outbound all-to-all."""
        counts = [0] * self.world_size
        for u in self.buckets[bucket]:
            counts[self.owners[u]] += self.units[u].numel_on(rank, self.world_size)
        return counts

    def recv_counts(self, bucket: int, rank: int) -> list[int]:
        """Elements `rank` receives from each rank in the bucket's outbound all-to-all.

        The return trip uses the same two lists swapped.
        """
        return [
            sum(self.units[u].numel_on(src, self.world_size) for u in self.owned_units(bucket, rank))
            for src in range(self.world_size)
        ]

    def ns_flops(self, rank: int, ns_steps: int) -> int:
        return sum(
            newton_schulz_flops(self.units[u].rows, self.units[u].cols, ns_steps)
            for u, owner in enumerate(self.owners)
            if owner == rank
        )

    def elements_sent(self, rank: int) -> int:
        """Elements `rank` puts on the wire per step (outbound to owners + return trip), self excluded."""
        total = 0
        for b in range(len(self.buckets)):
            outbound = self.send_counts(b, rank)
            inbound = self.recv_counts(b, rank)  # what returns, as the owner
            total += sum(outbound) - outbound[rank] + sum(inbound) - inbound[rank]
        return total

    def fingerprint(self) -> int:
        """A 63-bit digest of the whole plan, equal on ranks that computed the same plan."""
        digest = hashlib.sha256(repr((self.world_size, self.units, self.owners, self.buckets)).encode())
        return int.from_bytes(digest.digest()[:8], "little") >> 1


def offsets(counts: list[int]) -> list[int]:
    """Start of each block in a buffer holding blocks of `counts` elements back to back."""
    starts, total = [], 0
    for c in counts:
        starts.append(total)
        total += c
    return starts


def make_buckets(unit_bytes: list[int], bucket_bytes: int) -> list[list[int]]:
    """Consecutive units, each bucket at most `bucket_bytes` unless a single unit is larger."""
    buckets: list[list[int]] = []
    filled = 0
    for u, size in enumerate(unit_bytes):
        if not buckets or filled + size > bucket_bytes:
            buckets.append([])
            filled = 0
        buckets[-1].append(u)
        filled += size
    return buckets


def assign_owners(costs: list[int], world_size: int) -> list[int]:
    """Longest-processing-time greedy: costliest unit first, to the least loaded rank (lowest on ties).

    Balancing the whole step (not each bucket) minimizes the slowest owner's Newton–Schulz
    time; LPT keeps it within the mean plus one unit.
    """
    owners = [-1] * len(costs)
    loads = [0] * world_size
    for u in sorted(range(len(costs)), key=lambda u: (-costs[u], u)):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        owners[u] = rank
        loads[rank] += costs[u]
    return owners


def build_plan(units: list[Unit], world_size: int, bucket_bytes: int, ns_steps: int = 5) -> Plan:
    """Bucket `units` in the given order (4-byte elements for sizing) and give each an owner."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    buckets = make_buckets([4 * unit.numel for unit in units], bucket_bytes)
    costs = [newton_schulz_flops(unit.rows, unit.cols, ns_steps) for unit in units]
    owners = assign_owners(costs, world_size)
    return Plan(world_size, tuple(units), tuple(owners), tuple(tuple(b) for b in buckets))
