"""Where every Muon matrix lives: the optimizer's parameters, their rank sets and their units.

A Muon parameter is a plain tensor (one process, or replicated) or a DTensor whose placements
give every rank one block of it (layout.py). The ranks a parameter is sharded over form its
**rank set**; models can mix several (DeepSeek-V3 under tensor parallelism replicates the
MLA down-projections over TP, so they are sharded over the FSDP ranks only while the
up-projections are sharded over FSDP × TP). Each rank set gets its own exchange (exchange.py);
the step's agreements run over the one rank set that contains all the others.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate

from titan_muon.base.dtensor import local_shard
from titan_muon.attention.split import RowBlocks, match_row_blocks, row_block_ranges
from titan_muon.base.layout import RankGrid, Sharding, replicated, sharding_of
from titan_muon.exchange.plan import Unit
from titan_muon.exchange.transport import cached_group
from titan_muon.settings import check_group_params


@dataclass
class MuonParam:
    """A Muon parameter and where its elements live."""

    param: Tensor
    name: str
    group: dict  # rebound after load_state_dict, which replaces the group dicts
    group_index: int
    index: int  # position among the Muon parameters: same on every rank and after a resume
    sharding: Sharding | None  # None: this rank holds the whole parameter
    rank_set: int | None = None  # index into the optimizer's rank sets; None when held whole
    momentum_on_owner: bool = False  # its momentum lives whole on its matrices' owners (overlap, DeMo)

    def stack(self, t: Tensor) -> Tensor:
        """This rank's block of `t` (the parameter, its gradient or its state) as (matrices, rows, cols)."""
        local = local_shard(t)
        return local.unsqueeze(0) if local.ndim == 2 else local


def collect_muon_params(param_groups: list[dict], name_of: Callable[[int, int], str]) -> list[MuonParam]:
    """The Muon groups' parameters, in order, after checking every group's parameters (`name_of(group,
    index)` names one in errors): Muon's are matrices or stacks of them, AdamW's floating point."""
    entries: list[MuonParam] = []
    for gi, group in enumerate(param_groups):
        check_group_params(group, gi, name_of)
        if group["use_muon"]:
            for pi, p in enumerate(group["params"]):
                entries.append(MuonParam(p, name_of(gi, pi), group, gi, len(entries), None))
    return entries


@dataclass
class RankSet:
    """The ranks some Muon parameters are sharded over: their process group and parameters."""

    group: dist.ProcessGroup
    ranks: tuple[int, ...]  # global ranks, sorted
    params: list[int] = field(default_factory=list)  # MuonParam indices


def sharded_mesh_dims(p: DTensor) -> list[int]:
    return [d for d, placement in enumerate(p.placements) if not isinstance(placement, Replicate)]


def locate(entries: Sequence[MuonParam], others: Sequence[tuple[str, Tensor]] = ()) -> tuple[list[RankSet], dist.ProcessGroup | None]:
    """Fill in every entry's sharding and rank set; return the rank sets (in the order their
    first parameter appears, the same on every rank) and the group the step agrees over.

    `others` are the optimizer's other parameters (AdamW's), by name. The step's agreements span
    the ranks of every parameter, not only of the Muon matrices: a model part with no sharded Muon
    matrix (torchtitan's pipeline split makes stages of ``norm`` and ``output`` alone) must still
    skip or raise on all of its ranks together, else its ranks step apart and the pipeline waits.

    Raises ValueError, naming parameters, if a parameter's local block is not what its
    placements say, or if this rank's rank sets do not nest inside one of them.
    """
    sets: list[RankSet] = []
    by_ranks: dict[tuple[int, ...], int] = {}
    grids: dict[tuple[int, tuple[int, ...]], RankGrid] = {}  # (mesh, rank set) -> grid: O(W) once, not per parameter
    for entry in entries:
        p = entry.param
        if not isinstance(p, DTensor) or not sharded_mesh_dims(p):
            continue
        mesh, dims = p.device_mesh, sharded_mesh_dims(p)
        ranks = _ranks_along(mesh, dims, mesh.get_coordinate())
        key = tuple(sorted(ranks))
        if key not in by_ranks:
            by_ranks[key] = len(sets)
            group = mesh.get_group(dims[0]) if len(dims) == 1 else cached_group(_FLATTENED_GROUPS, key)
            sets.append(RankSet(group, key))
        rank_set = sets[by_ranks[key]]
        order = dist.get_process_group_ranks(rank_set.group)
        if (id(mesh), key) not in grids:
            coordinates = _coordinates(mesh)
            grids[(id(mesh), key)] = RankGrid([coordinates[int(r)] for r in order])
        grid = grids[(id(mesh), key)]
        entry.sharding = _sharding(p, entry.name, grid)
        entry.rank_set = by_ranks[key]
        rank_set.params.append(entry.index)
        rank = order.index(dist.get_rank())
        expected = tuple(hi - lo for lo, hi in entry.sharding.box(rank))[3 - p.ndim :]
        if tuple(local_shard(p).shape) != expected:
            raise ValueError(
                f"titan_muon.Muon: parameter {entry.name!r} holds a local block of shape {tuple(local_shard(p).shape)} "
                f"on rank {rank}, but its placements {p.placements} give {expected} (torch.chunk-style splits, "
                "as FSDP2 and DTensor make them, are supported)"
            )
    spans = {s.ranks: (s.group, entries[s.params[0]].name) for s in sets}  # ranks -> (group, first parameter)
    for name, p in others:
        if isinstance(p, DTensor) and sharded_mesh_dims(p):
            dims = sharded_mesh_dims(p)
            key = tuple(sorted(_ranks_along(p.device_mesh, dims, p.device_mesh.get_coordinate())))
            if key not in spans:
                group = p.device_mesh.get_group(dims[0]) if len(dims) == 1 else cached_group(_FLATTENED_GROUPS, key)
                spans[key] = (group, name)
    if not spans:
        return sets, None
    covering = max(spans, key=len)  # the first of the largest: a Muon rank set where one is largest
    for ranks, (_, first) in spans.items():
        if not set(ranks) <= set(covering):
            raise ValueError(
                f"titan_muon.Muon: parameter {first!r} is sharded over ranks {list(ranks)}, which are not all among "
                f"the ranks {list(covering)} of {spans[covering][1]!r}; one optimizer needs the "
                "rank sets of its parameters to nest inside one of them"
            )
    return sets, spans[covering][0]


def build_units(entries: Sequence[MuonParam], row_blocks: Mapping[str, RowBlocks]) -> tuple[dict[int | None, list[Unit]], list[Sharding]]:
    """The Newton–Schulz units of every rank set (key None: matrices this rank holds whole), in
    reverse parameter order — the order in which backward finishes gradients — and every
    parameter's sharding (a single-rank one for whole parameters)."""
    blocks = match_row_blocks([e.name for e in entries if e.param.ndim == 2], row_blocks)
    units: dict[int | None, list[Unit]] = {}
    for entry in reversed(entries):
        matrices, rows, cols = (1, *entry.param.shape) if entry.param.ndim == 2 else tuple(entry.param.shape)
        target = units.setdefault(entry.rank_set, [])
        for m in range(matrices):
            for start, end in row_block_ranges(rows, blocks.get(entry.name, rows), entry.name):
                target.append(Unit(entry.index, m, start, end, cols))
    shardings = [e.sharding or replicated(e.param.shape) for e in entries]
    return units, shardings


_FLATTENED_GROUPS: dict[tuple[int, ...], dist.ProcessGroup] = {}


def _ranks_along(mesh, dims: list[int], coordinate: list[int]) -> list[int]:
    index = tuple(slice(None) if d in dims else coordinate[d] for d in range(mesh.ndim))
    return [int(r) for r in mesh.mesh[index].reshape(-1).tolist()]


def _coordinates(mesh) -> dict[int, tuple[int, ...]]:
    """Every rank's coordinate in `mesh` (one pass over the mesh, not one search per rank)."""
    ranks = mesh.mesh.reshape(-1).tolist()
    return dict(zip(map(int, ranks), itertools.product(*(range(n) for n in mesh.mesh.shape))))


def _sharding(p: DTensor, name: str, grid: RankGrid) -> Sharding:
    try:
        return sharding_of(tuple(p.shape), p.placements, tuple(p.device_mesh.mesh.shape), grid)
    except NotImplementedError as error:
        raise ValueError(f"titan_muon.Muon: parameter {name!r}: {error}") from error
