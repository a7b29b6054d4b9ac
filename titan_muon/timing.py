"""Step timings that measure the device's work, not the host's, and named phases for profilers.

On CUDA, kernels run asynchronously: ``time.perf_counter`` around them measures the launch,
not the work. There the timer records CUDA events and computes the elapsed time only when
someone reads it (a logging step), so timing costs no host sync. Elsewhere (CPU, meta) it
uses the host clock.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Callable

import torch
from torch.profiler import record_function


class StepTimer:
    """Named intervals, each possibly started and stopped several times (their sum is reported).

    ``event_factory`` makes the device events (CUDA: ``torch.cuda.Event(enable_timing=True)``);
    tests pass a stand-in that enforces CUDA's contract on a CPU.
    """

    def __init__(self, device: torch.device, event_factory=None):
        self.cuda = device.type == "cuda" or event_factory is not None
        self._event = event_factory or (lambda: torch.cuda.Event(enable_timing=True))
        self._open: dict[str, object] = {}
        self._closed: dict[str, list] = defaultdict(list)

    def _now(self):
        if self.cuda:
            event = self._event()
            event.record()
            return event
        return time.perf_counter()

    def start(self, name: str) -> None:
        self._open[name] = self._now()

    def stop(self, name: str) -> None:
        self._closed[name].append((self._open.pop(name), self._now()))

    def elapsed_ms(self, name: str) -> float | Callable[[], float]:
        """Total milliseconds of `name`: a number, or on CUDA a function that reads the events."""
        intervals = self._closed.get(name, [])
        if not self.cuda:
            return 1e3 * sum(stop - start for start, stop in intervals)

        def read() -> float:
            # CUDAEvent.elapsed_time raises unless both events have completed ("Both events must
            # be completed"); reading metrics is the documented host sync, so wait for them here.
            total = 0.0
            for start, stop in intervals:
                start.synchronize()
                stop.synchronize()
                total += start.elapsed_time(stop)
            return total

        return read


class PhaseClock:
    """Host time per phase of the steps run inside ``with PhaseClock() as clock:``, in
    ``clock.ms[name]`` (a phase entered several times, or nested in another, adds each
    interval). For CPU benchmarks that must not pay torch.profiler's cost per operation
    (scripts/bench_beyond_ns.py); on CUDA the host clock times launches, not the work."""

    active: PhaseClock | None = None

    def __init__(self):
        self.ms: dict[str, float] = defaultdict(float)

    def __enter__(self) -> PhaseClock:
        self._outer, PhaseClock.active = PhaseClock.active, self
        return self

    def __exit__(self, *exc) -> None:
        PhaseClock.active = self._outer

    @contextlib.contextmanager
    def timed(self, name: str, marker: record_function):
        """`marker` (phase's profiler range) entered, and the time inside it added to ms[name]."""
        started = time.perf_counter()
        try:
            with marker:
                yield
        finally:
            self.ms[name] += 1e3 * (time.perf_counter() - started)


def phase(name: str):
    """``with phase("commit"):`` marks a part of the step as ``titan_muon/commit`` in
    torch.profiler traces (torchtitan's ``--profiling.enable_profiling`` included); outside a
    profiler it costs one no-op record, about a microsecond. Inside a :class:`PhaseClock` it is
    timed too."""
    marker = record_function(f"titan_muon/{name}")
    return marker if PhaseClock.active is None else PhaseClock.active.timed(name, marker)
