"""The exchange engine: one rank set's rounds, its two lanes, the window and the memory account.

Every Muon matrix that no rank holds whole travels to its owner and back in owner-balanced
rounds (plan.py). This module runs that traffic for ``step()``, the backward-overlap hooks
(overlap.py) and checkpoint conversion (owner_state.py), on two lanes:

* the **outbound lane**, a communicator of its own — the one communicator the optimizer
  creates per rank set — carries pieces to their owners, from the hooks during backward and
  from ``step()``;
* the **return lane**, the process group the parameters are sharded over (FSDP's own, idle
  during ``step()``), carries the updates back.

Above 256 ranks on several nodes (``hierarchical_exchange``) each lane is instead a pair of
communicators, over the rank's node and over its rail, and every trip runs in two stages with a
relay between them (transport.py; docs/exchange.md, "W = 4096"); the rounds, owners and bytes
of the plan stay the same.

On NCCL each communicator is one in-order stream. With both directions on one communicator,
round r + K's outbound trip would queue behind round r's return, which cannot finish before
round r's owner has finished its Newton–Schulz: at most two owners would ever compute at once.
With two lanes a return never blocks an outbound trip. A round's outbound buffers are
packed before the owners' Newton–Schulz of the round before it is queued, so a rank that is
busy owning a large matrix never holds back the next round; at most ``rounds_in_flight``
outbound rounds are in the air ahead of the owners.

Failures: every rank takes part in every collective even after a local error, sending what
its buffers hold, so nobody waits forever; the error is settled collectively afterwards
(:func:`agree_on_success`). :class:`MemoryAccount` counts every buffer the step keeps alive.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from titan_muon.buffers import Buffers, FreshBuffers, cut_bytes
from titan_muon.base.layout import Sharding
from titan_muon.exchange.plan import Piece, Plan, RoundTables, Unit, build_plan, rank_tables, send_counts_by_round
from titan_muon.exchange.redistribute import (
    Batch,
    ColumnMap,
    assemble,
    disassemble,
    disassemble_into,
    outbound_slots,
    piece_columns,
    split_counts,
    unit_slots,
)
from titan_muon.exchange.reservation import RoundBuffers, RoundBytes
from titan_muon.exchange.transport import (
    Exchange,
    Route,
    Transport,
    build_route,
    choose_layout,
    lane_hierarchy,
    outbound_lane_group,
)
from titan_muon.timing import phase


@dataclass
class MemoryAccount:
    """Bytes of the buffers the step holds — exchange buffers in both directions, buffers that
    arrived during backward, Newton–Schulz batches and workspace, returned updates and new
    owner momentum kept for the commit — as they are allocated and dropped. Buffers are
    dropped only after the collective using them was waited for, so on CUDA the peak holds in
    stream order too (the caching allocator reuses memory in the order of the stream)."""

    live: int = 0
    peak: int = 0
    kept: int = 0  # of those, bytes kept from one step to the next (a CPU reservation: reservation.py)

    def add(self, n: int) -> None:
        self.live += n
        self.peak = max(self.peak, self.live)

    def free(self, n: int) -> None:
        self.live -= n


@dataclass
class StepFailure:
    """The first exception raised on this rank inside the failable part of the step."""

    error: BaseException | None = None
    where: str = ""

    def record(self, error: BaseException, where: str) -> None:
        if self.error is None:
            self.error, self.where = error, where


def agree_on_success(transport: Transport, failure: StepFailure, streaming: bool = False) -> None:
    """Raise the same error on every rank of `transport` if any of them recorded a failure
    (one tiny all-reduce, one host read). `streaming`: rounds were written as they returned, so
    the error says the parameters may be partially updated instead of unchanged."""
    mine = float(transport.rank + 1) if failure.error is not None else 0.0
    flag = transport.all_reduce(torch.full((1,), mine, device=transport.device), dist.ReduceOp.MAX)
    failed_rank = int(flag.tolist()[0]) - 1
    if failed_rank < 0 and failure.error is None:  # (a local failure raises whatever the read says: on meta it reads 0)
        return
    outcome = (
        "the rounds that had returned were written (commit='streaming'), so parameters and Muon momentum may be "
        "partially updated while AdamW state is unchanged; load a checkpoint before stepping again"
        if streaming
        else "no parameter or optimizer state was changed"
    )
    if failure.error is not None:
        raise RuntimeError(
            f"titan_muon.Muon: the optimizer step failed on rank {transport.rank} while {failure.where} "
            f"({type(failure.error).__name__}: {failure.error}); every rank stopped and {outcome}."
        ) from failure.error
    raise RuntimeError(
        f"titan_muon.Muon: the optimizer step failed on rank {failed_rank} of the Muon process group (its log "
        f"has the cause); every rank stopped and {outcome}."
    )


Fill = Callable[[list[tuple[Piece, Tensor]]], None]  # writes a round's outbound pieces into their slots of the send buffer
ReturnSlots = dict[int, list[tuple[Piece, Tensor]]]  # per owned unit, its pieces' views of the return buffer (unit_slots)
# round, owned batches, buffers, the return buffer's slots (taken on the first call) -> result per
# unit not written into those slots, bytes it counted
Orthogonalize = Callable[[int, list[Batch], Buffers, Callable[[], ReturnSlots]], tuple[dict[int, Tensor], int]]
Receive = Callable[[int, Piece, Tensor], None]  # round, outbound piece, its update (a view of the return buffer)


class ExchangeEngine:
    """Round trips for the units of one rank set: ``plan`` (owners and rounds, the same on every
    rank of the set), ``tables`` (this rank's per-round tables), the two lanes. With hierarchical
    lanes, ``routes`` holds each round's :class:`~titan_muon.exchange.transport.Route` (both trips of a
    round use it, the return trip backwards) and the tables are in the lanes' buffer orders."""

    def __init__(self, plan: Plan, tables: tuple[RoundTables, ...], outbound: Transport, back: Transport, rounds_in_flight: int,
                 routes: tuple[Route, ...] | None = None, owners_hold_momentum: bool = False):  # fmt: skip
        self.plan, self.tables = plan, tables
        self.outbound, self.back = outbound, back
        self.routes = routes
        self.rounds_in_flight = rounds_in_flight
        self.device = back.device
        # Whether the owners keep these matrices' momentum whole (overlap, DeMo): then raw
        # gradients travel, and checkpoints convert the owners' blocks to the parameters' layout.
        self.owners_hold_momentum = owners_hold_momentum
        self.bytes_to_owners = 0  # sent by run()'s outbound trips (self excluded), for the step's metrics

    @property
    def rank(self) -> int:
        return self.back.rank

    @property
    def world_size(self) -> int:
        return self.back.world_size

    @property
    def units(self) -> tuple[Unit, ...]:
        return self.plan.units

    @property
    def sharded(self) -> bool:
        """False for the one-rank exchange of the matrices this rank holds whole."""
        return self.back.group is not None

    def owned_units(self) -> list[int]:
        return [u for tables in self.tables for u in tables.owned]

    def route(self, r: int, send_counts: tuple[int, ...] | None = None) -> Route | None:
        """Round `r`'s route (None for flat lanes), or None if `send_counts` (outbound sense) are
        not the round's own: the transport then gathers the node-mates' counts itself."""
        if self.routes is None or (send_counts is not None and send_counts != self.tables[r].send_counts):
            return None
        return self.routes[r]

    def _relay_buffers(self, failure: StepFailure, where: str, buffers: Buffers | None) -> Callable[[int], Tensor]:
        return lambda nbytes: self.buffer(nbytes, torch.uint8, failure, where, buffers)

    # ------------------------------------------------------------------ one direction

    def buffer(self, numel: int, dtype: torch.dtype, failure: StepFailure, where: str, buffers: Buffers | None = None) -> Tensor:
        """An exchange buffer from `buffers` (default: allocated). If that fails the failure is
        recorded and the buffer allocated instead: a rank that cannot allocate at all cannot take
        part in the collective, and the other ranks would wait for it until the communicator's timeout."""
        try:
            return (buffers or FreshBuffers(self.device)).take((numel,), dtype)
        except Exception as error:  # noqa: BLE001 - settled on every rank in agree_on_success
            failure.record(error, where)
            return torch.empty(numel, dtype=dtype, device=self.device)

    def counts(self, r: int, column_map: ColumnMap = piece_columns) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Round `r`'s (send, receive) element counts per peer in the outbound sense, for the
        parameters' own columns or, under `column_map`, a state tensor's (fp8 exponents)."""
        tables = self.tables[r]
        if column_map is piece_columns:
            return tables.send_counts, tables.recv_counts
        return split_counts(tables.outbound, self.world_size, column_map), split_counts(tables.inbound, self.world_size, column_map)

    def launch(self, r: int, dtype: torch.dtype, fill: Fill, failure: StepFailure, memory: MemoryAccount,
               column_map: ColumnMap = piece_columns, buffers: Buffers | None = None,
               receive_buffers: Buffers | None = None) -> Exchange:  # fmt: skip
        """Pack round `r`'s outbound pieces (``fill`` writes them, given every (piece, slot)) and start the outbound trip.
        After an error the buffer travels as it is: nothing it carries will be used. The send and relay
        buffers come from `buffers`, the receive buffer from `receive_buffers` (default: the same)."""
        tables = self.tables[r]
        send_counts, recv_counts = self.counts(r, column_map)
        send = self.buffer(sum(send_counts), dtype, failure, f"allocating round {r}'s send buffer", buffers)
        if failure.error is None:
            try:
                with phase("pack"):
                    fill(list(outbound_slots(tables, send, column_map)))
            except Exception as error:  # noqa: BLE001 - settled on every rank in agree_on_success
                failure.record(error, f"packing round {r}")
        recv = None
        if self.outbound.group is not None:  # a one-rank exchange receives its own buffer
            recv = self.buffer(sum(recv_counts) * send.element_size(), torch.uint8, failure, f"allocating round {r}'s receive buffer", receive_buffers or buffers)
        exchange = self.outbound.all_to_all(send, send_counts, recv_counts, recv=recv, route=self.route(r, send_counts),
                                            allocate=self._relay_buffers(failure, f"allocating round {r}'s relay buffers", buffers))  # fmt: skip
        memory.add(exchange.nbytes)
        return exchange

    def return_trip(self, r: int, back: Tensor, failure: StepFailure, column_map: ColumnMap = piece_columns,
                    buffers: Buffers | None = None) -> Exchange:  # fmt: skip
        """Start round `r`'s return trip of `back` (laid out like the inbound pieces): each rank
        receives its outbound pieces' share, in outbound order."""
        send_counts, recv_counts = self.counts(r, column_map)
        recv = None
        if self.back.group is not None:
            recv = self.buffer(sum(send_counts) * back.element_size(), torch.uint8, failure, f"allocating round {r}'s update buffer", buffers)
        relay = self._relay_buffers(failure, f"allocating round {r}'s return relay buffers", buffers)
        return self.back.all_to_all(back, recv_counts, send_counts, recv=recv, route=self.route(r, send_counts), allocate=relay)

    def round_bytes(self, r: int, dtype: torch.dtype, return_dtype: torch.dtype, owner_bytes: Callable[[RoundTables], int]) -> RoundBytes:
        """What round `r` cuts from each region of a reservation (reservation.py), as run() cuts it:
        send, the send buffer and the relay buffers; receive, over a communicator, the receive
        buffer; owner, ``owner_bytes(tables)`` (batches, results, workspace: the caller's); return,
        the return buffer and, over a communicator, the buffer the updates arrive in and the relays."""
        tables = self.tables[r]
        wire, back = dtype.itemsize, return_dtype.itemsize
        send, receive = cut_bytes((tables.send_numel,), dtype), 0
        returning = cut_bytes((tables.recv_numel,), return_dtype)
        if self.back.group is not None:
            receive = cut_bytes((tables.recv_numel * wire,), torch.uint8)
            returning += cut_bytes((tables.send_numel * back,), torch.uint8)
        if self.routes is not None:
            send += 2 * cut_bytes((self.routes[r].relay_elements(False) * wire,), torch.uint8)
            returning += 2 * cut_bytes((self.routes[r].relay_elements(True) * back,), torch.uint8)
        return RoundBytes(send, receive, owner_bytes(tables), returning)

    # ------------------------------------------------------------------ the step's round trips

    def run(
        self,
        *,
        dtype: torch.dtype,
        return_dtype: torch.dtype,
        fill: Fill,
        orthogonalize: Orthogonalize,
        key_of: Callable[[int], object],
        receive: Receive,
        failure: StepFailure,
        memory: MemoryAccount,
        arrived: dict[int, Exchange] | None = None,
        settle: Callable[[int], None] | None = None,
        returned: Callable[[int], None] | None = None,
        rounds: RoundBuffers | None = None,
        in_place: Callable[[object], bool] | None = None,
    ) -> list[Exchange]:
        """Every round's round trip, ``rounds_in_flight`` outbound trips ahead of the owners.

        Pieces travel out in `dtype` and come back in `return_dtype`. ``arrived``: rounds whose
        outbound trip already happened (during backward), each taken out of the dict once used. Returns the return exchanges, whose buffers hold the updates
        handed to ``receive``: they stay alive until the commit. ``settle(r)``, if given, runs
        after round r's owner work on every rank, whether that work ran, failed or was skipped
        after an earlier failure: DeMo's owners complete their collective across replicas there.
        ``returned(r)``, if given, runs once round r's updates have all been handed to ``receive``
        (unless this rank failed before); the updates' buffer is then dropped, not held.
        ``rounds``: where each round's buffers come from (default: allocated; reservation.py).
        ``in_place(key)``: the batches of that key are read where they arrived (assemble), so the
        round's receive buffer stays alive through its owner work (a reservation then holds one
        receive slot more: round r + rounds_in_flight lands during round r's Newton–Schulz).
        """
        arrived = arrived if arrived is not None else {}  # each taken out once used, so its buffers can go
        rounds_buffers = rounds if rounds is not None else RoundBuffers(self.device)
        self.bytes_to_owners = 0
        for exchange in arrived.values():  # both buffers stay alive until the round is waited for
            memory.add(exchange.nbytes)
        rounds = len(self.tables)
        outbound: dict[int, Exchange] = {}
        launched = 0

        def launch_through(limit: int) -> None:
            nonlocal launched
            while launched < min(limit, rounds):
                if launched not in arrived:
                    outbound[launched] = self.launch(launched, dtype, fill, failure, memory, buffers=rounds_buffers.send(launched),
                                                     receive_buffers=rounds_buffers.receive(launched))  # fmt: skip
                    tables = self.tables[launched]
                    self.bytes_to_owners += dtype.itemsize * (tables.send_numel - tables.send_counts[self.rank])
                launched += 1

        launch_through(self.rounds_in_flight)
        returning: list[tuple[int, Exchange]] = []
        held: list[Exchange] = []
        for r in range(rounds):
            tables = self.tables[r]
            exchange = arrived.pop(r) if r in arrived else outbound.pop(r)
            memory.free(exchange.nbytes - exchange.received.numel())  # the send buffer, once done
            received = exchange.wait()
            batches, batch_bytes, back, counted, arrivals_read = None, 0, None, 0, 0
            if failure.error is None:
                try:
                    with phase("assemble"):
                        batches = assemble(tables, received, self.units, key_of, rounds_buffers.owner(r), in_place)
                    batch_bytes = sum(b.matrices.numel() * b.matrices.element_size() for b in batches if b.matrices is not None)
                    memory.add(batch_bytes)
                    if any(b.matrices is None for b in batches):
                        arrivals_read = exchange.received.numel()  # read by the owner work where it lies
                except Exception as error:  # noqa: BLE001 - settled on every rank in agree_on_success
                    failure.record(error, f"assembling round {r}")
            memory.free(exchange.received.numel() - arrivals_read)  # copied into the batches: its buffer can go
            del exchange, received
            launch_through(r + 1 + self.rounds_in_flight)  # queued before this round's NS
            if len(returning) == self.rounds_in_flight:  # the oldest return, in before this round's is packed
                held += self._receive(*returning.pop(0), receive, returned, failure, memory)
            if batches is not None and failure.error is None:
                slots: ReturnSlots | None = None

                def return_slots() -> ReturnSlots:
                    """The return buffer, taken before Newton–Schulz writes into it."""
                    nonlocal back, slots, counted
                    if slots is None:
                        back = rounds_buffers.returning(r).take((tables.recv_numel,), return_dtype)
                        counted = back.numel() * back.element_size()
                        memory.add(counted)
                        slots = unit_slots(tables, back)
                    return slots

                try:
                    results, result_bytes = orthogonalize(r, batches, rounds_buffers.owner(r), return_slots)  # counted in `memory`
                    with phase("disassemble"):
                        if slots is None:
                            back = disassemble(tables, results, return_dtype, rounds_buffers.returning(r))
                            counted = back.numel() * back.element_size()  # alive beside the batches and results it is cut from
                            memory.add(counted)
                        else:
                            disassemble_into(slots, results)
                    memory.free(result_bytes)
                    del results, slots  # not alive through the next round's Newton-Schulz
                except Exception as error:  # noqa: BLE001 - settled on every rank in agree_on_success
                    failure.record(error, f"Newton-Schulz of round {r}")
            memory.free(batch_bytes + arrivals_read)
            del batches
            if settle is not None:
                settle(r)
            if back is None:
                back = self.buffer(tables.recv_numel, return_dtype, failure, f"allocating round {r}'s return buffer", rounds_buffers.returning(r))
            returning.append((r, self.return_trip(r, back, failure, buffers=rounds_buffers.returning(r))))
            memory.add(returning[-1][1].nbytes - counted)
        for r, exchange in returning:
            held += self._receive(r, exchange, receive, returned, failure, memory)
        return held

    def _receive(self, r: int, exchange: Exchange, receive: Receive, returned: Callable[[int], None] | None,
                 failure: StepFailure, memory: MemoryAccount) -> list[Exchange]:  # fmt: skip
        """Round r's updates handed to ``receive``; [the exchange] if its buffer must stay alive
        until the commit, [] once ``returned(r)`` has used them."""
        memory.free(exchange.nbytes - exchange.received.numel())  # the updates stay until used
        updates = exchange.wait()
        if failure.error is None:
            try:
                with phase("unpack"):
                    for piece, update in outbound_slots(self.tables[r], updates):
                        receive(r, piece, update)
                if returned is not None:
                    returned(r)
            except Exception as error:  # noqa: BLE001 - settled on every rank in agree_on_success
                failure.record(error, f"receiving round {r}")
        if returned is None:
            return [exchange]
        memory.free(exchange.received.numel())
        return []


# ---------------------------------------------------------------------- building the engines


@dataclass(frozen=True)
class EngineSettings:
    """What every engine of one optimizer is built with."""

    device: torch.device
    round_bytes: float  # per-rank bytes of one round's exchange buffers (plan.build_plan)
    owner_bytes: float  # an owner's bytes per element of an owned matrix (settings.owner_bytes_per_element)
    rounds_in_flight: int
    min_rounds: int  # at least this many rounds per rank set (overlap wants several)
    hierarchical_exchange: bool | str
    ranks_per_node: int | None
    owner_momentum: str | None  # None, "sharded" (overlap: the sharded matrices) or "all" (DeMo)


def build_engines(units: dict, shardings: Sequence[Sharding], groups: Sequence, unit_flops: Callable[[Unit], int],
                  settings: EngineSettings) -> list[ExchangeEngine]:  # fmt: skip
    """One engine per rank set (``groups[i]`` the process group of ``units[i]``), then, if this
    rank holds some matrices whole (``units[None]``), a one-rank engine for them: no collectives.
    Plans are checked to be the same on every rank of their set (a collective)."""
    engines = []
    for index, group in enumerate(groups):
        plan = build_plan(units[index], shardings, dist.get_world_size(group), settings.round_bytes, unit_flops,
                          settings.owner_bytes, min_rounds=settings.min_rounds)  # fmt: skip
        engines.append(_sharded_engine(group, plan, shardings, settings))
    if None in units:
        alone = Transport(None, settings.device)
        plan = build_plan(units[None], shardings, 1, settings.round_bytes, unit_flops, settings.owner_bytes)
        engines.append(ExchangeEngine(plan, rank_tables(plan, shardings, 0), alone, alone, settings.rounds_in_flight,
                                      owners_hold_momentum=settings.owner_momentum == "all"))  # fmt: skip
    return engines


def _sharded_engine(group, plan: Plan, shardings: Sequence[Sharding], settings: EngineSettings) -> ExchangeEngine:
    """The engine of one rank set: flat lanes, or hierarchical ones (a node and a rail
    communicator per lane, tables in their buffer orders, each round's route built from the
    node-mates' send counts, which the plan gives without any exchange)."""
    device, holds = settings.device, settings.owner_momentum is not None
    layout = choose_layout(settings.hierarchical_exchange, dist.get_process_group_ranks(group), settings.ranks_per_node)
    flat = Transport(group, device)
    digest = hashlib.sha256(repr((plan.fingerprint(), layout)).encode()).digest()
    flat.check_same_everywhere(int.from_bytes(digest[:8], "little") >> 1, "the Muon ownership plan")  # layout included
    if layout is None:
        tables = rank_tables(plan, shardings, flat.rank)
        outbound = Transport(outbound_lane_group(group), device)
        return ExchangeEngine(plan, tables, outbound, flat, settings.rounds_in_flight, owners_hold_momentum=holds)
    tables = rank_tables(plan, shardings, flat.rank, layout.local_major(), layout.node_major())
    node, _ = layout.place(flat.rank)
    mates = [send_counts_by_round(plan, shardings, mate) if mate != flat.rank else [t.send_counts for t in tables]
             for mate in layout.members[node]]  # fmt: skip
    routes = tuple(build_route(layout, flat.rank, t.send_counts, t.recv_counts, [m[r] for m in mates], device)
                   for r, t in enumerate(tables))  # fmt: skip
    outbound = Transport(group, device, lane_hierarchy(group, layout, "outbound"))
    back = Transport(group, device, lane_hierarchy(group, layout, "return"))
    return ExchangeEngine(plan, tables, outbound, back, settings.rounds_in_flight, routes, owners_hold_momentum=holds)
