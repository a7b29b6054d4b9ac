"""titan_muon/buffers.py and titan_muon/exchange/reservation.py on their own: how an arena cuts,
gives back and refuses, which rounds share a reservation's slots, and when a reservation is kept
from one step to the next."""

import pytest
import torch

from titan_muon.buffers import ALIGNMENT, Arena, FreshBuffers, cut_bytes
from titan_muon import Muon
from titan_muon.exchange.reservation import ReservationStore, RoundBytes, ReservedRounds, largest, reservation_bytes


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


def test_arrivals_read_in_place_hold_one_receive_slot_more():
    """Owners that read their arrivals where they landed (a CPU) read round r's receive buffer
    through its Newton-Schulz, after round r + rounds_in_flight has landed (engine.run launches it
    first): round r + rounds_in_flight must not take round r's receive slot."""
    sizes = RoundBytes(send=ALIGNMENT, receive=2 * ALIGNMENT, owner=3 * ALIGNMENT, returning=ALIGNMENT)
    in_flight = 2
    assert reservation_bytes(sizes, in_flight, arrivals_held=True) == reservation_bytes(sizes, in_flight) + 2 * ALIGNMENT
    rounds = ReservedRounds(torch.empty(reservation_bytes(sizes, in_flight, True), dtype=torch.uint8), sizes, in_flight, True)
    landed = [rounds.receive(r).take((2 * ALIGNMENT,), torch.uint8).data_ptr() for r in range(in_flight + 2)]
    assert len(set(landed[: in_flight + 1])) == in_flight + 1 and landed[in_flight + 1] == landed[0]
    sends = [rounds.send(r).take((ALIGNMENT,), torch.uint8).data_ptr() for r in range(in_flight + 1)]
    assert sends[in_flight] == sends[0]  # the other regions keep their slots


def test_a_kept_reservation_is_reused_while_its_size_holds_and_replaced_when_the_plan_changes():
    cpu = torch.device("cpu")
    kept = ReservationStore(cpu, keep=True)
    first = kept.take(1024)
    assert kept.take(1024) is first and kept.kept_bytes == 1024
    assert kept.take(2048) is not first and kept.kept_bytes == 2048  # another plan: the old storage goes
    fresh = ReservationStore(cpu, keep=False)
    assert fresh.take(1024) is not fresh.take(1024) and fresh.kept_bytes == 0


def _reservation_storages(keep_reservation, steps=3):
    """The storage each step's reservation was cut from, and the metrics, for one process stepping
    on a (64, 96) matrix; a second matrix is added before the last step (a new plan)."""
    import titan_muon.step.matrix_step as matrix_step

    params = [torch.nn.Parameter(torch.randn(64, 96))]
    opt = Muon(params, lr=0.01, keep_reservation=keep_reservation)
    seen, original = [], matrix_step.ReservedRounds

    def recording(storage, *args):
        seen.append(storage)
        return original(storage, *args)

    matrix_step.ReservedRounds = recording
    try:
        for step in range(steps):
            if step == steps - 1:
                extra = torch.nn.Parameter(torch.randn(128, 96))
                opt.add_param_group({"params": [extra]})
                params.append(extra)
            for p in params:
                p.grad = torch.randn_like(p)
            opt.step()
    finally:
        matrix_step.ReservedRounds = original
    return seen, opt.last_step_metrics


def test_keep_reservation_holds_the_storage_between_steps_and_reports_it():
    seen, metrics = _reservation_storages(True)
    assert seen[1] is seen[0] and seen[2] is not seen[0]  # kept, then replaced for the larger plan
    assert seen[2].numel() > seen[0].numel()
    assert metrics["muon/kept_reservation_bytes"] > 0
    assert metrics["muon/kept_reservation_bytes"] <= metrics["muon/peak_transient_bytes"]
    seen, metrics = _reservation_storages(False)
    assert seen[1] is not seen[0]
    assert metrics["muon/kept_reservation_bytes"] == 0
    # None keeps it on CPU (there is no caching allocator to hand the block back), not on accelerators
    assert Muon([torch.nn.Parameter(torch.zeros(4, 4))]).reservations.keep
    with pytest.raises(ValueError, match="keep_reservation must be True, False or None"):
        Muon([torch.nn.Parameter(torch.zeros(4, 4))], keep_reservation="on")


def test_the_reservation_layout_is_computed_once_per_plan_and_settings(monkeypatch):
    """reserve_rounds sizes the reservation from every round of the plan; the store keeps that
    layout while the wire and the groups' NS settings stay (a new plan brings a new store), and
    computes it again when they change."""
    import titan_muon.step.matrix_step as matrix_step

    calls, original = [], matrix_step.owner_bytes

    def counting(*args):
        calls.append(1)
        return original(*args)

    monkeypatch.setattr(matrix_step, "owner_bytes", counting)
    params = [torch.nn.Parameter(torch.randn(64, 96)), torch.nn.Parameter(torch.randn(32, 96))]
    opt = Muon(params, lr=0.01)
    counts = []
    for step in range(3):
        if step == 2:
            opt.param_groups[0]["ns_steps"] = 3
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
        counts.append(len(calls))
    # fp32 momentum on the shards, one process: "auto" streams and reserves from the first step on
    assert counts[0] > 0 and counts[1] == counts[0] and counts[2] == 2 * counts[0], counts


@pytest.mark.parametrize("rounds", [1, 3])
def test_the_reservation_holds_no_more_slots_than_the_plan_has_rounds(rounds):
    """A plan of one round (or three) reserves what rounds_in_flight = 1 (or 3) reserves, however
    many rounds may be in flight: the slots beyond the plan's rounds would never be used."""
    def reserved(in_flight):
        params = [torch.nn.Parameter(torch.randn(64, 96, generator=torch.Generator().manual_seed(i))) for i in range(rounds)]
        # each (64, 96) fp32 matrix alone fills a round's share of the window (24 KiB)
        opt = Muon(params, lr=0.01, exchange_memory_mb=0.025 * in_flight, rounds_in_flight=in_flight, keep_reservation=True)
        for p in params:
            p.grad = torch.ones_like(p)
        opt.step()
        assert opt.last_step_metrics["muon/rounds"] == rounds, opt.last_step_metrics["muon/rounds"]
        return opt.last_step_metrics["muon/kept_reservation_bytes"]

    assert reserved(rounds) > 0
    assert reserved(rounds + 1) == reserved(rounds) == reserved(8)
