"""titan_muon.torchtitan.train with one injected fault, for tests/test_faults.py and scripts/fault_scenarios.py.

    torchrun ... scripts/fault_train.py --job.config_file ...      (same arguments as titan_muon.torchtitan.train)

One environment variable picks the fault; it fires on rank FAULT_RANK (default 1) and only
in torchrun's first attempt (TORCHELASTIC_RESTART_COUNT=0), so a restarted group runs clean:

    FAULT_KILL_AFTER_STEP=N    SIGKILL the rank right after step N (and its checkpoint save)
    FAULT_KILL_IN_SAVE=N       SIGKILL the rank while it writes its shard of checkpoint step-N,
                               after the first chunk: a torn shard and no .metadata
    FAULT_PAUSE_AFTER_STEP=N   sleep for an hour after step N (the other ranks wait in the next
                               collective), so that a signal sent now lands mid-training

Nothing here is used by titan_muon itself.
"""

import contextlib
import os
import signal
import time
from pathlib import Path

from torch.distributed.checkpoint.filesystem import FileSystem
from torchtitan.train import main

from titan_muon.torchtitan import cpu
from titan_muon.torchtitan.v022.trainer import Trainer


def fault_step(name: str) -> int | None:
    """The step of fault ``name`` if it fires in this process, else None."""
    this_rank = os.environ.get("RANK") == os.environ.get("FAULT_RANK", "1")
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    value = os.environ.get(name)
    return int(value) if value and this_rank and first_attempt else None


def die() -> None:
    marker_dir = os.environ.get("FAULT_MARKER_DIR")  # torchrun may show only rank 0's output: say it in a file
    if marker_dir:
        Path(marker_dir, f"rank{os.environ.get('RANK')}-sigkill").touch()
    os.kill(os.getpid(), signal.SIGKILL)


class DiesAfterFirstWrite:
    """A file stream that lets one write through, flushes it to disk, then kills the process."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, data):
        written = self._stream.write(data)
        self._stream.flush()
        os.fsync(self._stream.fileno())
        die()
        return written

    def __getattr__(self, name):
        return getattr(self._stream, name)


def kill_in_save(step: int) -> None:
    """Make DCP's file writes of ``step-<step>/*.distcp`` on this rank die mid-file."""
    create_stream = FileSystem.create_stream

    @contextlib.contextmanager
    def create_stream_then_die(self, path, mode):
        with create_stream(self, path, mode) as stream:
            torn = os.path.basename(os.path.dirname(path)) == f"step-{step}" and str(path).endswith(".distcp")
            yield DiesAfterFirstWrite(stream) if torn else stream

    FileSystem.create_stream = create_stream_then_die


class FaultTrainer(Trainer):
    def train_step(self, *args, **kwargs):
        super().train_step(*args, **kwargs)
        if self.step == fault_step("FAULT_PAUSE_AFTER_STEP"):
            time.sleep(3600)

    def should_continue_training(self) -> bool:  # runs after the checkpoint save of self.step
        if self.step == fault_step("FAULT_KILL_AFTER_STEP"):
            die()
        return super().should_continue_training()


if __name__ == "__main__":
    if (step := fault_step("FAULT_KILL_IN_SAVE")) is not None:
        kill_in_save(step)
    if cpu.should_use_cpu():
        cpu.use_cpu_device()
    main(FaultTrainer)
