"""titan_muon/buffers.py and titan_muon/exchange/reservation.py on their own: how an arena cuts,
gives back and refuses, and which rounds share a reservation's slots."""

import pytest
import torch

from titan_muon.buffers import ALIGNMENT, Arena, FreshBuffers, cut_bytes
from titan_muon.exchange.reservation import RoundBytes, ReservedRounds, largest, reservation_bytes


def test_an_arena_cuts_aligned_views_gives_them_back_and_refuses_to_overflow():
    storage = torch.empty(4 * ALIGNMENT, dtype=torch.uint8)
    arena = Arena(storage)
    a = arena.take((3,), torch.float32)  # 12 bytes, then the next cut starts at the alignment
    mark = arena.mark()
    b = arena.take((2, 4), torch.bfloat16)
    assert a.data_ptr() == storage.data_ptr() and b.data_ptr() == storage.data_ptr() + ALIGNMENT
    assert b.shape == (2, 4) and b.dtype == torch.bfloat16 and b.is_contiguous()
    assert arena.take((0,), torch.float32).numel() == 0  # empty cuts take nothing
    arena.release(mark)
    assert arena.take((1,), torch.float16).data_ptr() == b.data_ptr()  # given back, cut again
    assert arena.high_water == ALIGNMENT + 16
    with pytest.raises(RuntimeError, match="sized too small"):
        arena.take((4 * ALIGNMENT,), torch.uint8)
    assert cut_bytes((3,), torch.float32) == ALIGNMENT and cut_bytes((64,), torch.float32) == ALIGNMENT
    assert FreshBuffers(torch.device("cpu")).take((2, 3), torch.float64).shape == (2, 3)


def test_rounds_in_flight_apart_share_a_slot_and_each_takes_it_over_whole():
    sizes = RoundBytes(send=ALIGNMENT, receive=2 * ALIGNMENT, owner=3 * ALIGNMENT, returning=ALIGNMENT)
    assert largest([sizes, RoundBytes(2 * ALIGNMENT, 0, 0, 0)]) == RoundBytes(2 * ALIGNMENT, 2 * ALIGNMENT, 3 * ALIGNMENT, ALIGNMENT)
    in_flight = 2
    storage = torch.empty(reservation_bytes(sizes, in_flight), dtype=torch.uint8)
    assert storage.numel() == in_flight * (1 + 2 + 1) * ALIGNMENT + 3 * ALIGNMENT
    rounds = ReservedRounds(storage, sizes, in_flight)
    first = rounds.send(0).take((ALIGNMENT,), torch.uint8)
    second = rounds.send(1).take((ALIGNMENT,), torch.uint8)
    assert first.data_ptr() != second.data_ptr()
    assert rounds.send(2).take((ALIGNMENT,), torch.uint8).data_ptr() == first.data_ptr()  # round 2 takes round 0's slot
    with pytest.raises(RuntimeError):  # the same round cutting twice its size: the slot is full
        rounds.send(2).take((1,), torch.uint8)
    owner = rounds.owner(0).take((3 * ALIGNMENT,), torch.uint8)
    assert rounds.owner(1).take((3 * ALIGNMENT,), torch.uint8).data_ptr() == owner.data_ptr()  # one area, every round
    rounds.next_engine()  # the next rank set's round 0 starts from an empty slot
    assert rounds.send(0).take((ALIGNMENT,), torch.uint8).data_ptr() == first.data_ptr()
    with pytest.raises(ValueError, match="cannot hold"):
        ReservedRounds(storage[:-1], sizes, in_flight)
