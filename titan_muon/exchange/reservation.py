"""The streaming step's memory, reserved before anything is written.

A streaming step writes round r's weights while rounds r + 1, … are still being packed,
orthogonalized and returned. If one of their buffers failed to allocate, the rank would be left
half-updated. So before the step's first agreement (agreement.py, which carries whether every
rank could reserve), each rank reserves one byte tensor sized from the plan and cuts every
round's buffers out of it, in three regions (engine.ExchangeEngine.run):

* **send**: ``rounds_in_flight`` slots (no more than the plan has rounds), used round-robin, each holding one round's send buffer
  and relay buffers. Round r's slot is taken again by round r + rounds_in_flight, which is packed
  only after round r's trip was waited for.
* **receive**: ``rounds_in_flight`` slots, each holding one round's receive buffer: round r's
  matrices are assembled out of it before round r + rounds_in_flight is launched. Where owners
  read their arrivals in place (``arrivals_held``: a CPU, engine.ExchangeEngine.run) round r's
  buffer is read through its Newton–Schulz, after round r + rounds_in_flight has landed: one slot
  more. (A one-rank exchange lands in its send buffer: its owner always assembles.)
* **owner**: one area, emptied at the start of every round: the assembled batches, their
  Newton–Schulz results (none on a CPU where NS computes in the wire dtype: its last product
  writes into the return buffer) and the workspace of one chunk at a time.
* **return**: ``rounds_in_flight`` slots, each holding one round's return buffer and the buffer
  its updates come back in. Round r's slot is taken again by round r + rounds_in_flight, whose
  return buffer is taken (before its NS where NS writes into it) only after round r's updates
  were written and dropped.

A slot is reused only by work queued after the work that last used it on the same stream (the
device's default stream waits for each collective before its buffers are read), so the reuse
holds in stream order on GPUs as on the host. The engines of several rank sets run one after
another and share the one reservation. Sizes are the sums of each cut as an Arena takes it
(buffers.cut_bytes), so a reservation can never be too small for the cuts it was sized for;
an Arena that would overflow raises (a bug) instead of allocating behind its back.

Where the bytes come from (:class:`ReservationStore`): on a GPU a fresh byte tensor every step,
which the caching allocator serves from the block the last step gave back, and which forward and
backward can use between steps. A CPU has no caching allocator: glibc maps an allocation this
large anew and every page of it faults in again inside the step (~0.8 s per step on the ~100M
model, docs/performance.md), so there the storage is kept from one step to the next.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, fields

import torch
from torch import Tensor

from titan_muon.buffers import Arena, Buffers, FreshBuffers


class RoundBuffers:
    """Where each round's buffers come from; this base allocates them fresh."""

    def __init__(self, device: torch.device):
        self.fresh = FreshBuffers(device)

    def send(self, r: int) -> Buffers:
        return self.fresh

    def receive(self, r: int) -> Buffers:
        return self.fresh

    def owner(self, r: int) -> Buffers:
        return self.fresh

    def returning(self, r: int) -> Buffers:
        return self.fresh


@dataclass(frozen=True)
class RoundBytes:
    """What one round cuts from each region (cut_bytes sums)."""

    send: int
    receive: int
    owner: int
    returning: int


class ReservedRounds(RoundBuffers):
    """Rounds cut out of `storage`, for an engine with `rounds_in_flight` and a plan of at most
    `rounds` rounds (None: any number): the regions' slots (module docstring), each as large as
    the largest round's cut from that region."""

    def __init__(self, storage: Tensor, sizes: RoundBytes, rounds_in_flight: int, arrivals_held: bool = False,
                 rounds: int | None = None):  # fmt: skip
        super().__init__(storage.device)
        self.bytes = reservation_bytes(sizes, rounds_in_flight, arrivals_held, rounds)
        if storage.numel() < self.bytes:
            raise ValueError(f"a reservation of {storage.numel()} bytes cannot hold {self.bytes}")
        self._regions, offset = {}, 0
        for name, count in _slots(rounds_in_flight, arrivals_held, rounds).items():
            size = getattr(sizes, name)
            self._regions[name] = [Arena(storage[offset + i * size : offset + (i + 1) * size]) for i in range(count)]
            offset += count * size
        self._taken: dict[tuple[str, int], int] = {}  # (region, slot) -> the round that last reset it

    def _slot(self, name: str, r: int) -> Arena:
        arenas = self._regions[name]
        index = r % len(arenas)
        arena = arenas[index]
        if self._taken.get((name, index)) != r:  # a new round takes the slot over from the round before
            arena.reset()
            self._taken[(name, index)] = r
        return arena

    def send(self, r: int) -> Buffers:
        return self._slot("send", r)

    def receive(self, r: int) -> Buffers:
        return self._slot("receive", r)

    def owner(self, r: int) -> Buffers:
        return self._slot("owner", r)

    def returning(self, r: int) -> Buffers:
        return self._slot("returning", r)

    def next_engine(self) -> None:
        """The next rank set's engine starts from empty regions (its rounds count from 0 again)."""
        self._taken.clear()


class ReservationStore:
    """Hands out a step's reservation: allocated anew each step, or (``keep``) kept from the last
    step when it has the same size, and then held between steps (``kept_bytes``). It lives with
    one plan (the optimizer makes a new one with every layout), so the reservation's layout is
    computed once per plan and per `key` of the settings it also depends on (:meth:`layout`)."""

    def __init__(self, device: torch.device, keep: bool):
        self.device, self.keep = device, keep
        self._kept: Tensor | None = None
        self._layout: tuple[Hashable, object] | None = None

    def layout(self, key: Hashable, compute: Callable[[], object]) -> object:
        """compute(), kept while `key` stays the same."""
        if self._layout is None or self._layout[0] != key:
            self._layout = (key, compute())
        return self._layout[1]

    @property
    def kept_bytes(self) -> int:
        return 0 if self._kept is None else self._kept.numel()

    def take(self, nbytes: int) -> Tensor:
        if self._kept is not None and self._kept.numel() == nbytes:
            return self._kept
        self._kept = None  # a plan of another size: give the old storage back before taking the new
        storage = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        if self.keep:
            self._kept = storage
        return storage


def _slots(rounds_in_flight: int, arrivals_held: bool = False, rounds: int | None = None) -> dict[str, int]:
    """How many slots each region holds. A plan of `rounds` rounds never uses more slots than it
    has rounds: round r takes slot r % count, so with count >= rounds each round has its own."""
    cap = float("inf") if rounds is None else max(1, rounds)
    in_flight = int(min(rounds_in_flight, cap))
    receive = int(min(rounds_in_flight + 1, cap)) if arrivals_held else in_flight
    return {"send": in_flight, "receive": receive, "owner": 1, "returning": in_flight}


def reservation_bytes(sizes: RoundBytes, rounds_in_flight: int, arrivals_held: bool = False, rounds: int | None = None) -> int:
    return sum(count * getattr(sizes, name) for name, count in _slots(rounds_in_flight, arrivals_held, rounds).items())


def largest(rounds: Sequence[RoundBytes]) -> RoundBytes:
    """Per region, the most any of `rounds` cuts from it."""
    return RoundBytes(*(max((getattr(b, f.name) for b in rounds), default=0) for f in fields(RoundBytes)))

