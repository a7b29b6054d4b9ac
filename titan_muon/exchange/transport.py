"""The only module that calls torch.distributed for Muon traffic.

Buffers travel as raw bytes (``uint8`` views) so any dtype works on every backend: gloo has
no float8 and its support for reduced precision differs between collectives. Every buffer
lives on the transport's device, the parameters' device: on CUDA the collectives run on the
NCCL group torchtitan created, with no host round trip.

A transport is flat (one ``all_to_all_single`` over the whole group: W − 1 peers per rank) or
**hierarchical** (:class:`Hierarchy`, docs/exchange.md "W = 4096"): the group's ranks form a
grid of nodes × ranks per node, and an all-to-all runs in two stages, one over the rank's node
(P − 1 peers, NVLink) and one over its *rail*, the ranks with the same local index on every
node (N − 1 peers, one NIC each). What a rank relays between the stages is regrouped on the
device by one gather (:class:`Route`, computed once per round from the plan).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from titan_muon.timing import phase


@dataclass
class Exchange:
    """An all-to-all in flight: `wait()` returns the received buffer in the sent dtype."""

    received: Tensor
    work: dist.Work | None
    dtype: torch.dtype
    sent: Tensor | None = None  # kept alive until the collective has read it
    relayed: tuple[Tensor, ...] = ()  # a hierarchical exchange's buffers between its two stages

    def wait(self) -> Tensor:
        if self.work is not None:
            with phase("wait"):
                self.work.wait()
            self.work = None
        if self.relayed and self.received.device.type == "cuda":
            # Written and read on the relay stream and NCCL's: the stream that waited for the
            # last stage is past every use, so their memory is reused only after that point.
            stream = torch.cuda.current_stream(self.received.device)
            for t in self.relayed:
                t.record_stream(stream)
        self.sent, self.relayed = None, ()
        return self.received.view(self.dtype)

    @property
    def nbytes(self) -> int:
        return self.received.nbytes + (0 if self.sent is None else self.sent.nbytes) + sum(t.nbytes for t in self.relayed)


def _used_by_default_stream(*tensors: Tensor) -> None:
    if tensors[0].device.type != "cuda":
        return
    default = torch.cuda.default_stream(tensors[0].device)
    if torch.cuda.current_stream(tensors[0].device) != default:
        for t in tensors:
            t.record_stream(default)


# ------------------------------------------------------------------ hierarchical all-to-all

# "auto" makes an exchange group hierarchical above this many ranks (docs/exchange.md, "W = 4096").
HIERARCHICAL_MIN_RANKS = 256


@dataclass(frozen=True)
class NodeLayout:
    """A process group's ranks as a grid: ``members[node][local]`` is a group rank. Nodes and
    local indices follow increasing global ranks, the rank order of the node and rail groups."""

    members: tuple[tuple[int, ...], ...]

    @staticmethod
    def of(global_ranks: Sequence[int], ranks_per_node: int) -> NodeLayout | None:
        """The grid of a group whose rank i is global rank ``global_ranks[i]``, a node being
        ``ranks_per_node`` consecutive global ranks (torchrun's numbering); None unless every
        node the group touches holds the same number of its ranks."""
        by_node: dict[int, list[int]] = {}
        for group_rank, global_rank in sorted(enumerate(global_ranks), key=lambda pair: pair[1]):
            by_node.setdefault(global_rank // ranks_per_node, []).append(group_rank)
        if len({len(members) for members in by_node.values()}) != 1:
            return None
        return NodeLayout(tuple(tuple(by_node[node]) for node in sorted(by_node)))

    @property
    def nodes(self) -> int:
        return len(self.members)

    @property
    def per_node(self) -> int:
        return len(self.members[0])

    def place(self, rank: int) -> tuple[int, int]:
        """(node, local index) of group rank `rank`."""
        return self._places[rank]

    @property
    def _places(self) -> dict[int, tuple[int, int]]:
        places = self.__dict__.get("_place_cache")
        if places is None:
            places = {rank: (n, i) for n, row in enumerate(self.members) for i, rank in enumerate(row)}
            object.__setattr__(self, "_place_cache", places)
        return places

    def node_major(self) -> tuple[int, ...]:
        """Each group rank's position when ranks are ordered by node, then local index: the
        order in which a forward exchange delivers (and a reverse one takes) its segments."""
        return self._positions(lambda node, local: node * self.per_node + local)

    def local_major(self) -> tuple[int, ...]:
        """Each group rank's position when ranks are ordered by local index, then node: the
        order in which a forward exchange takes (and a reverse one delivers) its segments."""
        return self._positions(lambda node, local: local * self.nodes + node)

    def _positions(self, key: Callable[[int, int], int]) -> tuple[int, ...]:
        positions = [0] * (self.nodes * self.per_node)
        for n, row in enumerate(self.members):
            for i, rank in enumerate(row):
                positions[rank] = key(n, i)
        return tuple(positions)


def choose_layout(setting: bool | str, global_ranks: Sequence[int], ranks_per_node: int | None) -> NodeLayout | None:
    """The grid a rank set's exchange runs on, or None for a flat all-to-all.

    ``setting`` is Muon's ``hierarchical_exchange``: "auto" picks the grid for groups of more
    than :data:`HIERARCHICAL_MIN_RANKS` ranks on at least two nodes; True insists (refusing a
    group that is no grid of at least 2 × 2); False never."""
    world = len(global_ranks)
    if setting is False or world == 1:
        return None
    if ranks_per_node is None:
        if setting is True:
            raise ValueError(
                "titan_muon.Muon: hierarchical_exchange=True needs the number of ranks per node: pass ranks_per_node "
                "(torchrun's LOCAL_WORLD_SIZE and, on CUDA, the visible GPU count are used when it is None)"
            )
        return None
    layout = NodeLayout.of(global_ranks, ranks_per_node)
    usable = layout is not None and layout.nodes >= 2 and layout.per_node >= 2
    if setting is True and not usable:
        shape = "nodes holding different numbers of its ranks" if layout is None else f"{layout.nodes} node(s) × {layout.per_node}"
        raise ValueError(
            f"titan_muon.Muon: hierarchical_exchange=True needs an exchange group of at least 2 nodes × 2 ranks with "
            f"the same number of ranks on every node; with ranks_per_node={ranks_per_node} the group of global ranks "
            f"{_short(global_ranks)} is {shape}. Use hierarchical_exchange=False or 'auto', or fix ranks_per_node."
        )
    if setting == "auto" and not (usable and world > HIERARCHICAL_MIN_RANKS):
        return None
    return layout


def _short(ranks: Sequence[int]) -> str:
    ranks = list(ranks)
    return str(ranks) if len(ranks) <= 8 else f"[{', '.join(map(str, ranks[:4]))}, ..., {ranks[-1]}] ({len(ranks)} ranks)"


@dataclass(frozen=True)
class Route:
    """One rank's part in one hierarchical all-to-all, in the forward direction: stage 1 over the
    node, stage 2 over the rail. A reverse exchange (the mirrored counts) runs it backwards.

    Counts are in elements. Between the stages the rank holds, from each node-mate l, the
    blocks it relays to each rail peer m (``blocks[l][m]`` elements, l-major); ``forward``
    gathers them m-major, in rows of ``unit`` elements (the blocks' gcd, so the index is small);
    ``backward`` is its inverse."""

    node_send: tuple[int, ...]
    node_recv: tuple[int, ...]
    rail_send: tuple[int, ...]
    rail_recv: tuple[int, ...]
    unit: int
    forward: Tensor
    backward: Tensor

    def relay_elements(self, reverse: bool) -> int:
        """Elements of each of the two relay buffers between the stages (Transport._two_stage):
        what stage 1 brings, over the node forwards, over the rail backwards."""
        return sum(self.rail_send if reverse else self.node_recv)


def build_route(layout: NodeLayout, rank: int, send_counts: Sequence[int], recv_counts: Sequence[int],
                mates_send_counts: Sequence[Sequence[int]], device: torch.device | str) -> Route:  # fmt: skip
    """`rank`'s route for a forward all-to-all with these per-group-rank counts;
    ``mates_send_counts[l]``: the send counts of the rank's node-mate with local index l (its own
    included). All of them are pure functions of the plan, so nothing is exchanged to build it."""
    node, local = layout.place(rank)
    members, nodes, per_node = layout.members, layout.nodes, layout.per_node
    if tuple(mates_send_counts[local]) != tuple(send_counts):
        raise ValueError("build_route: mates_send_counts[local] must be the rank's own send counts")
    blocks = [[mates_send_counts[i][members[m][local]] for m in range(nodes)] for i in range(per_node)]
    node_send = tuple(sum(send_counts[members[m][i]] for m in range(nodes)) for i in range(per_node))
    rail_recv = tuple(sum(recv_counts[members[m][i]] for i in range(per_node)) for m in range(nodes))
    node_recv = tuple(sum(row) for row in blocks)
    rail_send = tuple(sum(blocks[i][m] for i in range(per_node)) for m in range(nodes))
    unit = math.gcd(*(b for row in blocks for b in row)) or 1
    # Index arithmetic on the host, once per plan; only the two finished index tensors go to `device`.
    rows = torch.tensor(blocks, dtype=torch.int64, device="cpu").reshape(per_node, nodes) // unit
    starts = (rows.flatten().cumsum(0) - rows.flatten()).view(per_node, nodes)  # l-major offsets
    lengths, sources = rows.t().flatten(), starts.t().flatten()  # blocks in m-major order
    total = int(lengths.sum())
    within = torch.arange(total, dtype=torch.int64, device="cpu") - torch.repeat_interleave(lengths.cumsum(0) - lengths, lengths)
    forward = torch.repeat_interleave(sources, lengths) + within
    backward = torch.empty_like(forward)
    backward[forward] = torch.arange(total, dtype=torch.int64, device="cpu")
    index = torch.int32 if total < 2**31 else torch.int64
    return Route(node_send, node_recv, rail_send, rail_recv, unit, forward.to(index).to(device), backward.to(index).to(device))


class Hierarchy:
    """A hierarchical transport's two communicators and direction. ``reverse``: the lane carries
    owners' results back (rail first, then node), the mirror of the outbound lane's trips.

    On CUDA the relay between the stages (wait for stage 1, regroup, start stage 2) runs on a
    stream of its own, so the stream that started the exchange never waits for its first stage."""

    def __init__(self, layout: NodeLayout, rank: int, node_group: dist.ProcessGroup, rail_group: dist.ProcessGroup,
                 reverse: bool):  # fmt: skip
        self.layout, self.node_group, self.rail_group, self.reverse = layout, node_group, rail_group, reverse
        self.node, self.local = layout.place(rank)
        self._stream = None

    def relay_stream(self, device: torch.device):
        if device.type != "cuda":
            return contextlib.nullcontext()
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        self._stream.wait_stream(torch.cuda.current_stream(device))  # buffers it writes may be reused memory
        return torch.cuda.stream(self._stream)


class Transport:
    """Muon's collectives over one process group (None: a single process), on one device.

    With a `hierarchy`, all-to-alls run in two stages over its node and rail groups; `group`
    then only numbers the ranks (counts are per rank of `group`) and carries ``all_reduce``."""

    def __init__(self, group: dist.ProcessGroup | None, device: torch.device, hierarchy: Hierarchy | None = None):
        self.group = group
        self.hierarchy = hierarchy
        self.device = torch.device(device)
        self.world_size = 1 if group is None else dist.get_world_size(group)
        self.rank = 0 if group is None else dist.get_rank(group)
        self.bytes_sent = 0
        self.bytes_received = 0
        # Split sizes in bytes, per (element counts, item size): the schedules' count tuples
        # are fixed, so the O(world size) lists are built once, not per collective.
        self._byte_splits: dict[tuple[tuple[int, ...], int], tuple[list[int], int]] = {}

    def _split_bytes(self, counts: tuple[int, ...], itemsize: int) -> tuple[list[int], int]:
        """The byte split list of `counts` and the bytes that leave or reach other ranks."""
        key = (counts, itemsize)
        if key not in self._byte_splits:
            self._byte_splits[key] = ([c * itemsize for c in counts], itemsize * (sum(counts) - counts[self.rank]))
        return self._byte_splits[key]

    def all_to_all(
        self, send: Tensor, send_counts: tuple[int, ...], recv_counts: tuple[int, ...], recv: Tensor | None = None,
        route: Route | None = None, allocate: Callable[[int], Tensor] | None = None,
    ) -> Exchange:  # fmt: skip
        """Start an uneven all-to-all of `send` (1-D, counts in elements); returns at once.

        `recv` (uint8, optional) receives; otherwise a buffer is allocated. On CUDA, buffers
        made on another stream than the default one (FSDP2 runs the backward hooks on its
        post-reduce stream) are marked as used by the default stream, where ``step()`` reads
        them, so the caching allocator cannot hand their memory out early.

        Flat: `send` holds the segments for each rank in rank order, and so does the result.
        Hierarchical: segments in ``layout.local_major()`` order on a forward lane and
        ``node_major()`` on a reverse one; the result in the other order. `route` is this
        exchange's :class:`Route` (forward sense); without one it is built from the node-mates'
        counts, gathered over the node (one small all-gather and one host read: for rare calls
        such as checkpoint conversion). `allocate(bytes)` makes the relay buffers (uint8).
        """
        itemsize = send.element_size()
        if self.group is None:
            return Exchange(send.view(torch.uint8), None, send.dtype)
        if self.hierarchy is not None:
            return self._two_stage(send, send_counts, recv_counts, recv, route, allocate)
        recv_splits, received = self._split_bytes(tuple(recv_counts), itemsize)
        send_splits, sent = self._split_bytes(tuple(send_counts), itemsize)
        if recv is None:
            recv = torch.empty(sum(recv_splits), dtype=torch.uint8, device=self.device)
        _used_by_default_stream(recv, send)
        self.bytes_sent += sent
        self.bytes_received += received
        send_bytes = send.contiguous().view(torch.uint8)
        work = dist.all_to_all_single(
            recv,
            send_bytes,
            output_split_sizes=recv_splits,
            input_split_sizes=send_splits,
            group=self.group,
            async_op=True,
        )
        return Exchange(recv, work, send.dtype, send_bytes)

    def _two_stage(self, send: Tensor, send_counts, recv_counts, recv: Tensor | None, route: Route | None,
                   allocate: Callable[[int], Tensor] | None) -> Exchange:  # fmt: skip
        """Stage 1, the relay (a gather on the device), stage 2; the exchange waits for stage 2."""
        h = self.hierarchy
        if route is None:
            route = self._gathered_route(send_counts, recv_counts)
        if h.reverse:  # (group, send splits, receive splits, this rank's index in the group) per stage
            first, index, second = (h.rail_group, route.rail_recv, route.rail_send, h.node), route.backward, (h.node_group, route.node_recv, route.node_send, h.local)
        else:
            first, index, second = (h.node_group, route.node_send, route.node_recv, h.local), route.forward, (h.rail_group, route.rail_send, route.rail_recv, h.node)
        itemsize = send.element_size()
        allocate = allocate or (lambda nbytes: torch.empty(nbytes, dtype=torch.uint8, device=self.device))
        if recv is None:
            recv = allocate(sum(second[2]) * itemsize)
        relay = route.relay_elements(h.reverse) * itemsize
        middle = allocate(relay)  # what stage 1 brings, grouped by where it came from
        relayed = allocate(relay)  # the same, grouped by where it goes
        _used_by_default_stream(recv, send)
        send_bytes = send.contiguous().view(torch.uint8)
        work = self._stage(first, middle, send_bytes, itemsize)
        row = route.unit * itemsize
        with phase("relay"), h.relay_stream(self.device):
            work.wait()
            torch.index_select(middle.view(-1, row), 0, index, out=relayed.view(-1, row))
            work = self._stage(second, recv, relayed, itemsize)
        return Exchange(recv, work, send.dtype, send_bytes, (middle, relayed))

    def _stage(self, stage, out: Tensor, inp: Tensor, itemsize: int) -> dist.Work:
        group, send_splits, recv_splits, me = stage
        self.bytes_sent += itemsize * (sum(send_splits) - send_splits[me])
        self.bytes_received += itemsize * (sum(recv_splits) - recv_splits[me])
        return dist.all_to_all_single(
            out, inp, output_split_sizes=[c * itemsize for c in recv_splits],
            input_split_sizes=[c * itemsize for c in send_splits], group=group, async_op=True,
        )  # fmt: skip

    def _gathered_route(self, send_counts, recv_counts) -> Route:
        """The route of an exchange whose counts only this call knows: the node-mates' counts in
        the forward sense (a reverse lane's receive counts) come from one all-gather over the node."""
        h = self.hierarchy
        mine, theirs = (recv_counts, send_counts) if h.reverse else (send_counts, recv_counts)
        local = torch.tensor(mine, dtype=torch.int64, device=self.device)
        gathered = [torch.empty_like(local) for _ in range(h.layout.per_node)]
        dist.all_gather(gathered, local, group=h.node_group)
        mates = [tuple(row) for row in torch.stack(gathered).tolist()]
        return build_route(h.layout, self.rank, mine, theirs, mates, self.device)

    def all_reduce(self, tensor: Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> Tensor:
        if self.group is not None:
            dist.all_reduce(tensor, op=op, group=self.group)
        return tensor

    def all_gather(self, send: Tensor) -> Tensor:
        """Every rank's `send` (1-D, the same size everywhere), as (world_size, numel), in rank
        order; blocks until done. Counted as a ring all-gather: every rank sends and receives
        (world_size − 1) blocks."""
        if self.group is None:
            return send.reshape(1, -1)
        out = torch.empty(self.world_size * send.numel(), dtype=send.dtype, device=self.device)
        dist.all_gather_single(out, send.contiguous(), group=self.group)
        nbytes = (self.world_size - 1) * send.numel() * send.element_size()
        self.bytes_sent += nbytes
        self.bytes_received += nbytes
        return out.view(self.world_size, -1)

    def check_same_everywhere(self, value: int, what: str) -> None:
        """Raise the same error on every rank unless all ranks pass the same 63-bit `value`.

        Runs once, when the optimizer is built (it reads the result on the host).
        """
        if self.group is None:
            return
        pair = torch.tensor([value, -value], dtype=torch.int64, device=self.device)
        self.all_reduce(pair, dist.ReduceOp.MAX)
        high, low = pair.tolist()
        if high != -low:
            raise RuntimeError(
                f"titan_muon: {what} differs between ranks of the process group "
                f"(this rank: {value:#x}). Every rank must build the optimizer from the same model "
                "with the same parameter order, shapes and settings."
            )


@contextlib.contextmanager
def uncounted(*transports: Transport):
    """Traffic that belongs to no step (checkpoint conversions): kept out of the byte counters that
    a step's ``muon/bytes_sent`` / ``bytes_received`` read, which would otherwise include it."""
    counters = [(t.bytes_sent, t.bytes_received) for t in transports]
    try:
        yield
    finally:
        for transport, (sent, received) in zip(transports, counters):
            transport.bytes_sent, transport.bytes_received = sent, received


_LANE_GROUPS: dict[tuple[int, ...], dist.ProcessGroup] = {}


def outbound_lane_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """The communicator that carries pieces to their owners: one per rank set, created once per
    process and reused. Returns travel on `group` itself (the mesh's group, idle during
    ``step()``), so on NCCL — one in-order stream per communicator — a return trip never
    queues ahead of the next outbound one."""
    if group is None:
        return None
    return cached_group(_LANE_GROUPS, tuple(sorted(dist.get_process_group_ranks(group))))


def cached_group(cache: dict[tuple[int, ...], dist.ProcessGroup], ranks: tuple[int, ...]) -> dist.ProcessGroup:
    """A process group over `ranks` from `cache`, created (by those ranks only) if missing or if
    it belonged to a process group world that has since been destroyed. Re-planning reuses it."""
    group = cache.get(ranks)
    if group is not None:
        try:
            dist.get_process_group_ranks(group)
        except (KeyError, ValueError, RuntimeError):  # not a group of the current world any more
            group = None
    if group is None:
        group = cache[ranks] = dist.new_group(list(ranks), use_local_synchronization=True)
    return group


class AcrossReplicas(Transport):
    """The step's agreements when the optimizer owns a replicate dimension (DeMo): an all-reduce
    over ``within`` (one replica's ranks) and then over ``replicas`` (this rank and the ranks at
    the same place in the other replicas) reduces over every rank of every replica, so every
    replica reaches the same verdict. ``rank`` is the global rank (unique, for error messages)."""

    def __init__(self, within: Transport, replicas: Transport):
        super().__init__(replicas.group, replicas.device)
        self.within, self.replicas = within, replicas
        self.world_size = within.world_size * replicas.world_size
        self.rank = dist.get_rank()

    def all_reduce(self, tensor: Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> Tensor:
        return self.replicas.all_reduce(self.within.all_reduce(tensor, op), op)


_HIERARCHY_GROUPS: dict[tuple[str, str], dict[tuple[int, ...], dist.ProcessGroup]] = {}


def lane_hierarchy(group: dist.ProcessGroup, layout: NodeLayout, lane: str) -> Hierarchy:
    """The node and rail communicators of one lane ("outbound" or "return") of the rank set
    `group` laid out as `layout`: created once per process and lane (each rank creates its own
    node's and rail's, with their members only), reused when the optimizer re-plans. Each lane
    has its own pair, so a return trip never queues ahead of an outbound one (docs/exchange.md)."""
    ranks = dist.get_process_group_ranks(group)
    rank = dist.get_rank(group)
    node, local = layout.place(rank)
    node_ranks = tuple(ranks[r] for r in layout.members[node])
    rail_ranks = tuple(ranks[row[local]] for row in layout.members)
    node_group = cached_group(_HIERARCHY_GROUPS.setdefault((lane, "node"), {}), node_ranks)
    rail_group = cached_group(_HIERARCHY_GROUPS.setdefault((lane, "rail"), {}), rail_ranks)
    return Hierarchy(layout, rank, node_group, rail_group, reverse=lane == "return")
