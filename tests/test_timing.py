"""Step timings on CUDA: reading them right after step() must not raise (issue 19, item 2); host
times per phase for CPU benchmarks."""

import time

import pytest
import torch

from titan_muon import Muon
from titan_muon.timing import PhaseClock, StepTimer, phase


class StrictEvent:
    """A stand-in for torch.cuda.Event with CUDA's contract: elapsed_time raises unless both
    events have completed, and an event completes only when synchronized (the device is
    asynchronous: nothing has run until the host waits)."""

    clock = 0.0

    def __init__(self):
        self.recorded_at, self.completed = None, False

    def record(self):
        StrictEvent.clock += 1.5
        self.recorded_at = StrictEvent.clock

    def synchronize(self):
        self.completed = True

    def elapsed_time(self, end):
        if not (self.completed and end.completed):
            raise RuntimeError("Both events must be completed before calculating elapsed time.")
        return end.recorded_at - self.recorded_at


def test_reading_device_timings_right_after_the_step_waits_for_the_events():
    timer = StepTimer(torch.device("cpu"), event_factory=StrictEvent)
    timer.start("ns")
    timer.stop("ns")
    timer.start("ns")
    timer.stop("ns")
    read = timer.elapsed_ms("ns")
    assert callable(read)  # device timings stay on the device until someone reads them
    assert read() == pytest.approx(3.0)  # two intervals of 1.5, read without a prior synchronize


def test_phase_clock_adds_each_interval_of_a_phase_and_nests():
    """Sleeps of known length: each phase's total is at least what was slept in it (the clock
    can only add scheduling delay) and below it plus a generous 0.5 s of delay; a phase outside
    the clock is not counted, and the clock ends with its block."""
    with phase("outside"):
        pass
    with PhaseClock() as clock:
        for _ in range(2):
            with phase("wait"):
                time.sleep(0.02)
        with phase("commit"):
            time.sleep(0.01)
            with phase("wait"):
                time.sleep(0.01)
    with phase("after"):
        pass
    assert PhaseClock.active is None
    assert set(clock.ms) == {"wait", "commit"}
    assert 50 <= clock.ms["wait"] < 550
    assert 20 <= clock.ms["commit"] < 520


def test_phase_clock_times_the_phases_of_a_step():
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(32, 16)), torch.nn.Parameter(torch.randn(16))]
    opt = Muon([{"params": params[:1]}, {"params": params[1:], "use_muon": False}])
    for p in params:
        p.grad = torch.randn_like(p)
    with PhaseClock() as clock:
        opt.step()
    assert {"check_gradients", "newton_schulz", "adamw"} <= set(clock.ms)
    assert all(ms >= 0 for ms in clock.ms.values())
