"""Start ``titan_muon.train`` under torchrun and read back what it logged.

Used by the tests and by scripts/compare_optimizers.py. Every launch has a timeout, so a
hung collective fails the caller instead of blocking it.
"""

import glob
import os
import signal
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def torchrun_command(config: str, overrides: list[str], nproc: int = 2, rdzv: list[str] | None = None) -> list[str]:
    rendezvous = rdzv if rdzv is not None else ["--standalone"]
    return [
        sys.executable, "-m", "torch.distributed.run", *rendezvous, "--nproc-per-node", str(nproc),
        "--local-ranks-filter", "0", "-m", "titan_muon.train", "--job.config_file", config, *overrides,
    ]  # fmt: skip


def start(command: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start torchrun in a process group of its own, for :func:`stop`."""
    return subprocess.Popen(
        command,
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def finish(process: subprocess.Popen, timeout: float) -> subprocess.CompletedProcess:
    """Wait for ``process``; past ``timeout`` (or if interrupted) kill torchrun and its workers."""
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except BaseException:  # the timeout, or the caller interrupted (Ctrl-C, pytest-timeout)
        stop(process)
        raise
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def stop(process: subprocess.Popen, grace: float = 30) -> None:
    """SIGTERM first: torchrun then stops its workers, which run in sessions of their own."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(process.pid, sig)
            process.communicate(timeout=grace)
            return
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue


def run_training(
    config: str, overrides: list[str], nproc: int = 2, timeout: float = 300, check: bool = True
) -> subprocess.CompletedProcess:
    """Run to completion; with ``check``, raise with the log's tail if it failed."""
    result = finish(start(torchrun_command(config, overrides, nproc)), timeout)
    if check and result.returncode != 0:
        raise RuntimeError(f"training failed (exit {result.returncode}):\n{log_tail(result)}")
    return result


def log_tail(result: subprocess.CompletedProcess, chars: int = 6000) -> str:
    return (result.stdout + result.stderr)[-chars:]


def read_scalars(dump_folder: str, tag: str) -> dict[int, float]:
    """``{step: value}`` of one TensorBoard tag over all runs logged under ``dump_folder``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    values = {}
    for run_dir in sorted(glob.glob(os.path.join(dump_folder, "tb", "*"))):
        events = EventAccumulator(run_dir, size_guidance={"scalars": 0})
        events.Reload()
        if tag in events.Tags()["scalars"]:
            values.update({event.step: event.value for event in events.Scalars(tag)})
    return values


def read_losses(dump_folder: str) -> dict[int, float]:
    return read_scalars(dump_folder, "loss_metrics/global_avg_loss")
