"""Where the elements of a parameter live: pure geometry of DTensor placements.

A Muon parameter is viewed as a stack of matrices ``(matrices, rows, cols)``: a 2-D weight is
one matrix, a grouped MoE expert weight ``[experts, out, in]`` is one matrix per expert. Under
any mix of FSDP2 ``Shard(0)``, tensor-parallel ``Shard(0)`` / ``Shard(1)``, expert-parallel
``Shard(0)`` and FSDP2's ``_StridedShard`` on top of TP, every rank holds one rectangular
*box* of that stack: a contiguous range along each dimension (DTensor splits like
``torch.chunk``). This module computes those boxes for any rank, and which ranks hold a part
of a given box, without touching torch.distributed: the ownership plan is built from it on
every rank alike.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import Placement, _StridedShard

Range = tuple[int, int]  # [start, stop)
Box = tuple[Range, Range, Range]  # (matrices, rows, cols)


def chunk_range(size: int, parts: int, index: int) -> Range:
    """Range of chunk `index` when `size` elements are split like ``torch.chunk(parts)``.

    Chunks have ceil(size / parts) elements; trailing chunks may be short or empty.
    """
    chunk = -(-size // parts)
    return min(index * chunk, size), min((index + 1) * chunk, size)


def chunks_overlapping(size: int, parts: int, lo: int, hi: int) -> range:
    """Indices of the non-empty chunks of a ``torch.chunk(parts)`` split that overlap [lo, hi)."""
    if hi <= lo or size == 0:
        return range(0)
    chunk = -(-size // parts)
    return range(lo // chunk, min(parts, -(-hi // chunk)))


def intersect(a: Range, b: Range) -> Range | None:
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return (lo, hi) if lo < hi else None


def box_numel(box: Box) -> int:
    n = 1
    for lo, hi in box:
        n *= max(0, hi - lo)
    return n


def as_stack_shape(shape: Sequence[int]) -> tuple[int, int, int]:
    """(matrices, rows, cols) of a 2-D or 3-D parameter."""
    if len(shape) == 2:
        return (1, shape[0], shape[1])
    if len(shape) == 3:
        return tuple(shape)
    raise ValueError(f"expected a 2-D matrix or a 3-D stack of matrices, got shape {tuple(shape)}")


@dataclass(frozen=True)
class ShardOp:
    """One split of tensor dimension `dim` (of the stack view) into `parts` along mesh dimension `mesh_dim`."""

    mesh_dim: int
    dim: int
    parts: int


def shard_ops(placements: Sequence[Placement], mesh_shape: Sequence[int], ndim: int) -> tuple[ShardOp, ...]:
    """The order in which a DTensor's placements split its dimensions, in stack coordinates.

    DTensor applies ``Shard`` placements from the first mesh dimension to the last.
    ``_StridedShard(d, split_factor=s)`` (what FSDP2 puts on its mesh dimension when TP already
    shards dim d) means the split happens *after* the following splits of dim d whose mesh
    sizes multiply to s, so each rank still holds one contiguous range. Other uses of
    ``_StridedShard`` would give non-contiguous pieces and are refused.
    """
    offset = 3 - ndim  # a 2-D parameter's dims are the stack's rows and cols
    ops: list[ShardOp] = []
    deferred: list[tuple[ShardOp, int]] = []  # (split, remaining split factor to wait for)
    for mesh_dim, placement in enumerate(placements):
        if isinstance(placement, Replicate):
            continue
        if isinstance(placement, _StridedShard):
            deferred.append((ShardOp(mesh_dim, placement.dim + offset, mesh_shape[mesh_dim]), placement.split_factor))
            continue
        if not isinstance(placement, Shard):
            raise NotImplementedError(f"placement {placement} is not supported (Shard, _StridedShard or Replicate)")
        op = ShardOp(mesh_dim, placement.dim + offset, mesh_shape[mesh_dim])
        ops.append(op)
        still = []
        for waiting, factor in deferred:
            if waiting.dim == op.dim:
                if factor % op.parts:
                    raise NotImplementedError(f"placements {tuple(placements)}: strided split factor does not match the mesh")
                factor //= op.parts
            if factor == 1:
                ops.append(waiting)
            else:
                still.append((waiting, factor))
        deferred = still
    if deferred:
        raise NotImplementedError(f"placements {tuple(placements)} do not give each rank a contiguous block")
    return tuple(ops)


class RankGrid:
    """The mesh coordinates of the ranks of one process group, shared by every parameter on that mesh.

    ``coordinates[g]`` is the full mesh coordinate of group rank g; the group's ranks differ
    only along the mesh dimensions that shard its tensors.
    """

    def __init__(self, coordinates: Sequence[Sequence[int]]):
        self.coordinates = tuple(tuple(c) for c in coordinates)
        self._lookups: dict[tuple[int, ...], dict[tuple[int, ...], int]] = {}

    def __len__(self) -> int:
        return len(self.coordinates)

    def __repr__(self) -> str:
        return f"RankGrid({self.coordinates})"

    def __eq__(self, other) -> bool:
        return isinstance(other, RankGrid) and self.coordinates == other.coordinates

    def __hash__(self) -> int:
        return hash(self.coordinates)

    def rank_at(self, mesh_dims: tuple[int, ...], values: tuple[int, ...]) -> int:
        """The group rank whose coordinate along `mesh_dims` is `values`."""
        lookup = self._lookups.get(mesh_dims)
        if lookup is None:
            lookup = {tuple(c[d] for d in mesh_dims): g for g, c in enumerate(self.coordinates)}
            self._lookups[mesh_dims] = lookup
        return lookup[values]


SINGLE_RANK = RankGrid([()])


@dataclass(frozen=True)
class Sharding:
    """How a (matrices, rows, cols) stack is spread over the ranks of a process group."""

    shape: tuple[int, int, int]
    mesh_shape: tuple[int, ...]
    ops: tuple[ShardOp, ...]
    grid: RankGrid

    @property
    def world_size(self) -> int:
        return len(self.grid)

    @property
    def whole_box(self) -> Box:
        return tuple((0, n) for n in self.shape)

    def box(self, rank: int) -> Box:
        """The block rank `rank` holds (possibly empty)."""
        return _apply(self.whole_box, self.ops, self.grid.coordinates[rank])

    def holders(self, region: Box) -> Iterator[tuple[int, Box]]:
        """(rank, intersection) for every rank that holds a non-empty part of `region`, in mesh order.

        Follows the splits in order into the chunks that meet `region` only, carrying the
        intersection along (each split narrows one dimension of it).
        """
        piece = tuple(intersect(whole, wanted) for whole, wanted in zip(self.whole_box, region))
        if not all(piece):
            return
        if not self.ops:  # a single rank holds everything
            yield self.grid.rank_at((), ()), piece
            return
        mesh_dims = tuple(op.mesh_dim for op in self.ops)
        last = len(self.ops) - 1

        def walk(depth: int, box: Box, piece: Box, coordinate: tuple[int, ...]) -> Iterator[tuple[int, Box]]:
            op = self.ops[depth]
            lo, hi = box[op.dim]
            want_lo, want_hi = piece[op.dim]  # box ∩ region along the split dimension
            for index in chunks_overlapping(hi - lo, op.parts, want_lo - lo, want_hi - lo):
                start, stop = chunk_range(hi - lo, op.parts, index)
                start, stop = lo + start, lo + stop
                narrowed = piece[: op.dim] + ((max(start, want_lo), min(stop, want_hi)),) + piece[op.dim + 1 :]
                if depth == last:
                    yield self.grid.rank_at(mesh_dims, coordinate + (index,)), narrowed
                else:
                    inner = box[: op.dim] + ((start, stop),) + box[op.dim + 1 :]
                    yield from walk(depth + 1, inner, narrowed, coordinate + (index,))

        yield from walk(0, self.whole_box, piece, ())


def _apply(whole: Box, ops: Sequence[ShardOp], coordinate: Sequence[int]) -> Box:
    box = list(whole)
    for op in ops:
        lo, hi = box[op.dim]
        start, stop = chunk_range(hi - lo, op.parts, coordinate[op.mesh_dim])
        box[op.dim] = (lo + start, lo + stop)
    return tuple(box)


def local_block(shape: Sequence[int], placements: Sequence[Placement], mesh_shape: Sequence[int], coordinate: Sequence[int]) -> Box:
    """The (matrices, rows, cols) block that the rank at mesh `coordinate` holds of a DTensor."""
    stack = as_stack_shape(shape)
    return _apply(tuple((0, n) for n in stack), shard_ops(placements, mesh_shape, len(shape)), coordinate)


def replicated(shape: Sequence[int]) -> Sharding:
    """A stack held whole by a single-rank group: a plain tensor in one process."""
    return Sharding(as_stack_shape(shape), (), (), SINGLE_RANK)


def sharding_of(shape: Sequence[int], placements: Sequence[Placement], mesh_shape: Sequence[int], grid: RankGrid) -> Sharding:
    """The Sharding of a DTensor of global `shape` with `placements` on a mesh of `mesh_shape`,
    over the process group whose ranks' mesh coordinates `grid` lists."""
    ops = shard_ops(placements, mesh_shape, len(shape))
    return Sharding(as_stack_shape(shape), tuple(mesh_shape), ops, grid)
