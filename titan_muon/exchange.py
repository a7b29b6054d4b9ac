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

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from titan_muon.plan import Piece, Plan, RoundTables, Unit
from titan_muon.redistribute import Batch, assemble, disassemble, outbound_slots
from titan_muon.timing import phase
from titan_muon.transport import Exchange, Route, Transport


@dataclass
class MemoryAccount:
    """Bytes of the buffers the step holds — exchange buffers in both directions, buffers that
    arrived during backward, Newton–Schulz batches and workspace, returned updates and new
    owner momentum kept for the commit — as they are allocated and dropped. Buffers are
    dropped only after the collective using them was waited for, so on CUDA the peak holds in
    stream order too (the caching allocator reuses memory in the order of the stream)."""

    live: int = 0
    peak: int = 0

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


def agree_on_success(transport: Transport, failure: StepFailure) -> None:
    """Raise the same error on every rank of `transport` if any of them recorded a failure
    (one tiny all-reduce, one host read)."""
    mine = float(transport.rank + 1) if failure.error is not None else 0.0
    flag = transport.all_reduce(torch.full((1,), mine, device=transport.device), dist.ReduceOp.MAX)
    failed_rank = int(flag.tolist()[0]) - 1
    if failed_rank < 0:
        return
    if failure.error is not None:
        raise RuntimeError(
            f"titan_muon.Muon: the optimizer step failed on rank {transport.rank} while {failure.where} "
            f"({type(failure.error).__name__}: {failure.error}); every rank stopped and no parameter or optimizer "
            "state was changed."
        ) from failure.error
    raise RuntimeError(
        f"titan_muon.Muon: the optimizer step failed on rank {failed_rank} of the Muon process group (its log "
        "has the cause); every rank stopped and no parameter or optimizer state was changed."
    )


Fill = Callable[[Piece, Tensor], None]  # writes one outbound piece into its slot of the send buffer
Orthogonalize = Callable[[int, list[Batch]], dict[int, Tensor]]  # round, owned batches -> result per unit (counted by it)
Receive = Callable[[int, Piece, Tensor], None]  # round, outbound piece, its update (a view of the return buffer)


class ExchangeEngine:
    """Round trips for the units of one rank set: ``plan`` (owners and rounds, the same on every
    rank of the set), ``tables`` (this rank's per-round tables), the two lanes. With hierarchical
    lanes, ``routes`` holds each round's :class:`~titan_muon.transport.Route` (both trips of a
    round use it, the return trip backwards) and the tables are in the lanes' buffer orders."""

    def __init__(self, plan: Plan, tables: tuple[RoundTables, ...], outbound: Transport, back: Transport, rounds_in_flight: int,
                 routes: tuple[Route, ...] | None = None):  # fmt: skip
        self.plan, self.tables = plan, tables
        self.outbound, self.back = outbound, back
        self.routes = routes
        self.rounds_in_flight = rounds_in_flight
        self.device = back.device
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

    def owned_units(self) -> list[int]:
        return [u for tables in self.tables for u in tables.owned]

    def route(self, r: int, send_counts: tuple[int, ...] | None = None) -> Route | None:
        """Round `r`'s route (None for flat lanes), or None if `send_counts` (outbound sense) are
        not the round's own: the transport then gathers the node-mates' counts itself."""
        if self.routes is None or (send_counts is not None and send_counts != self.tables[r].send_counts):
            return None
        return self.routes[r]

    def _relay_buffers(self, failure: StepFailure, where: str) -> Callable[[int], Tensor]:
        return lambda nbytes: self.buffer(nbytes, torch.uint8, failure, where)

    # ------------------------------------------------------------------ one direction

    def buffer(self, numel: int, dtype: torch.dtype, failure: StepFailure, where: str) -> Tensor:
        """A fresh exchange buffer. If the allocation fails the failure is recorded and the
        allocation retried once: a rank that cannot allocate at all cannot take part in the
        collective, and the other ranks would wait for it until the communicator's timeout."""
        try:
            return torch.empty(numel, dtype=dtype, device=self.device)
        except Exception as error:  # noqa: BLE001 - settled on every rank in agree_on_success
            failure.record(error, where)
            return torch.empty(numel, dtype=dtype, device=self.device)

    def launch(self, r: int, dtype: torch.dtype, fill: Fill, failure: StepFailure, memory: MemoryAccount) -> Exchange:
        """Pack round `r`'s outbound pieces (``fill`` writes each one) and start the outbound trip.
        After an error the buffer travels as it is: nothing it carries will be used."""
        tables = self.tables[r]
        send = self.buffer(tables.send_numel, dtype, failure, f"allocating round {r}'s send buffer")
        if failure.error is None:
            try:
                with phase("pack"):
                    for piece, slot in outbound_slots(tables, send):
                        fill(piece, slot)
            except Exception as error:  # noqa: BLE001 - settled on every rank in agree_on_success
                failure.record(error, f"packing round {r}")
        recv = None
        if self.outbound.group is not None:  # a one-rank exchange receives its own buffer
            recv = self.buffer(tables.recv_numel * send.element_size(), torch.uint8, failure, f"allocating round {r}'s receive buffer")
        exchange = self.outbound.all_to_all(send, tables.send_counts, tables.recv_counts, recv=recv, route=self.route(r),
                                            allocate=self._relay_buffers(failure, f"allocating round {r}'s relay buffers"))  # fmt: skip
        memory.add(exchange.nbytes)
        return exchange

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
    ) -> list[Exchange]:
        """Every round's round trip, ``rounds_in_flight`` outbound trips ahead of the owners.

        Pieces travel out in `dtype` and come back in `return_dtype`. ``arrived``: rounds whose
        outbound trip already happened (during backward). Returns the return exchanges, whose buffers hold the updates
        handed to ``receive``: they stay alive until the commit. ``settle(r)``, if given, runs
        after round r's owner work on every rank, whether that work ran, failed or was skipped
        after an earlier failure: DeMo's owners complete their collective across replicas there.
        """
        arrived = dict(arrived or {})
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
                    outbound[launched] = self.launch(launched, dtype, fill, failure, memory)
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
            launch_through(r + 1 + self.rounds_in_flight)  # queued before this round's NS
            back = None
            if failure.error is None:
                try:
                    with phase("assemble"):
                        batches = assemble(tables, received, self.units, key_of)
                    batch_bytes = sum(b.matrices.numel() * b.matrices.element_size() for b in batches)
                    memory.add(batch_bytes)
                    results = orthogonalize(r, batches)  # counts its results in `memory`
                    with phase("disassemble"):
                        back = disassemble(tables, results, return_dtype, self.device)
                    memory.free(batch_bytes + sum(t.numel() * t.element_size() for t in results.values()))
                except Exception as error:  # noqa: BLE001 - settled on every rank in agree_on_success
                    failure.record(error, f"Newton-Schulz of round {r}")
            if settle is not None:
                settle(r)
            memory.free(exchange.received.numel())
            del exchange, received
            if back is None:
                back = self.buffer(tables.recv_numel, return_dtype, failure, f"allocating round {r}'s return buffer")
            recv = None
            if self.back.group is not None:
                recv = self.buffer(tables.send_numel * back.element_size(), torch.uint8, failure, f"allocating round {r}'s update buffer")
            relay = self._relay_buffers(failure, f"allocating round {r}'s return relay buffers")
            returning.append((r, self.back.all_to_all(back, tables.recv_counts, tables.send_counts, recv=recv, route=self.route(r),
                                                      allocate=relay)))  # fmt: skip
            memory.add(returning[-1][1].nbytes)
            if len(returning) > self.rounds_in_flight:
                held.append(self._receive(*returning.pop(0), receive, failure, memory))
        for r, exchange in returning:
            held.append(self._receive(r, exchange, receive, failure, memory))
        return held

    def _receive(self, r: int, exchange: Exchange, receive: Receive, failure: StepFailure, memory: MemoryAccount) -> Exchange:
        memory.free(exchange.nbytes - exchange.received.numel())  # the updates stay until the commit
        updates = exchange.wait()
        if failure.error is None:
            try:
                with phase("unpack"):
                    for piece, update in outbound_slots(self.tables[r], updates):
                        receive(r, piece, update)
            except Exception as error:  # noqa: BLE001 - settled on every rank in agree_on_success
                failure.record(error, f"receiving round {r}")
        return exchange
