"""Where the step's buffers come from: fresh allocations, or cuts of memory reserved in advance.

A streaming step writes weights while later rounds are still being computed, so an allocation
that fails after the first write would leave a rank half-updated. It therefore reserves, before
the first write, one arena per region of the step (exchange.engine.StepReservation) and cuts
every exchange buffer, Newton–Schulz batch, workspace and result out of them; the functions that
fill those buffers take a :class:`Buffers` and never call ``torch.empty`` themselves. The
atomic commit, the backward hooks and checkpoint conversion allocate as they go
(:class:`FreshBuffers`). Both give the same numbers: the same kernels write the same values,
only the memory differs.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
from torch import Tensor

# Every cut starts at a multiple of this many bytes: GEMMs and vectorized element-wise kernels
# want aligned operands (cudaMalloc itself aligns to 256 bytes), and any dtype's view is valid.
ALIGNMENT = 256


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGNMENT) * ALIGNMENT


def cut_bytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    """The bytes one cut of `shape` in `dtype` takes from an arena, alignment included."""
    return aligned(math.prod(shape) * dtype.itemsize)


class Buffers(Protocol):
    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        """An uninitialized contiguous tensor of `shape` and `dtype`."""

    def mark(self) -> int:
        """A point to :meth:`release` back to: everything taken after it is given back at once."""

    def release(self, mark: int) -> None: ...


class FreshBuffers:
    """Allocates every buffer anew on `device` (the caching allocator reuses freed memory)."""

    def __init__(self, device: torch.device):
        self.device = device

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        return torch.empty(shape, dtype=dtype, device=self.device)

    def mark(self) -> int:
        return 0

    def release(self, mark: int) -> None:
        pass  # fresh buffers go when their last reference does


class Arena:
    """Cuts buffers out of one reserved byte tensor, one after another (a stack): :meth:`release`
    gives back everything cut after a :meth:`mark`, :meth:`reset` everything. ``high_water`` is
    the most it ever held: what a reservation for the same cuts must be at least."""

    def __init__(self, storage: Tensor):
        if storage.dtype != torch.uint8 or storage.ndim != 1:
            raise ValueError("an Arena's storage is a 1-D uint8 tensor")
        self.storage, self.offset, self.high_water = storage, 0, 0

    @property
    def capacity(self) -> int:
        return self.storage.numel()

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        shape = tuple(shape)
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes == 0:
            return self.storage[:0].view(dtype).view(shape)
        start = aligned(self.offset)
        if start + nbytes > self.capacity:
            # The reservation is sized from the plan with the same cuts: reaching this is a bug,
            # reported instead of allocating behind the reservation's back.
            raise RuntimeError(
                f"titan_muon: a reserved arena of {self.capacity} bytes cannot hold {nbytes} more bytes at offset {start} "
                f"(a {tuple(shape)} {dtype} buffer): the step's reservation was sized too small"
            )
        self.offset = start + nbytes
        self.high_water = max(self.high_water, self.offset)
        return self.storage[start : start + nbytes].view(dtype).view(shape)

    def mark(self) -> int:
        return self.offset

    def release(self, mark: int) -> None:
        self.offset = mark

    def reset(self) -> None:
        self.offset = 0
