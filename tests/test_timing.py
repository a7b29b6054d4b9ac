"""Step timings on CUDA: reading them right after step() must not raise (issue 19, item 2)."""

import pytest
import torch

from titan_muon.timing import StepTimer


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
