"""Start ``titan_muon.torchtitan.train`` under torchrun and read back what it logged.

Used by the tests and by scripts/compare_optimizers.py. Every launch has a timeout, so a
hung collective fails the caller instead of blocking it.
"""

import glob
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]

# torch 2.13's torchrun shares one TCPStore across worker restarts, and restarted workers
# then read stale process-group keys (docs/reliability.md); a fresh store per restart avoids it.
TORCHRUN_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def torchrun_command(
    config: str,
    overrides: list[str],
    nproc: int = 2,
    rdzv: list[str] | None = None,
    max_restarts: int = 0,
    entry: tuple[str, ...] = ("-m", "titan_muon.torchtitan.train"),
) -> list[str]:
    """``entry``: the module (``-m name``) or script (path) torchrun runs on every rank."""
    rendezvous = rdzv if rdzv is not None else ["--standalone"]
    return [
        sys.executable, "-m", "torch.distributed.run", *rendezvous, "--nproc-per-node", str(nproc),
        "--max-restarts", str(max_restarts), "--local-ranks-filter", "0",
        *entry, "--job.config_file", config, *overrides,
    ]  # fmt: skip


def start(command: list[str], env: dict[str, str] | None = None, log_file: str | None = None) -> subprocess.Popen:
    """Start torchrun in a process group of its own, for :func:`stop`.

    With ``log_file``, stdout and stderr go to that file, which can be read while the run
    goes on (:func:`wait_for_log`); otherwise to pipes that :func:`finish` reads.
    """
    output = open(log_file, "w") if log_file else subprocess.PIPE  # noqa: SIM115 (the child holds it)
    try:
        return subprocess.Popen(
            command,
            cwd=REPO_ROOT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **TORCHRUN_ENV, **(env or {})},
            stdout=output,
            stderr=subprocess.STDOUT if log_file else subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
    finally:
        if log_file:
            output.close()


def finish(process: subprocess.Popen, timeout: float) -> subprocess.CompletedProcess:
    """Wait for ``process``; past ``timeout`` (or if interrupted) kill torchrun and its workers."""
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except BaseException:  # the timeout, or the caller interrupted (Ctrl-C, pytest-timeout)
        stop(process)
        raise
    return subprocess.CompletedProcess(process.args, process.returncode, stdout or "", stderr or "")


def wait_for_log(log_file: str, text: str, process: subprocess.Popen, timeout: float) -> None:
    """Return once ``text`` is in ``log_file``; raise if ``process`` ends first or time runs out."""
    deadline = time.monotonic() + timeout
    while True:
        with open(log_file) as log:
            if text in log.read():
                return
        if process.poll() is not None:
            raise RuntimeError(f"the run ended (exit {process.returncode}) before logging {text!r}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{text!r} not logged within {timeout} s")
        time.sleep(0.2)


def child_pids(pid: int) -> list[int]:
    """Direct children of ``pid`` (Linux /proc): the workers of a torchrun process."""
    children = []
    for task in glob.glob(f"/proc/{pid}/task/*/children"):
        with open(task) as f:
            children += [int(child) for child in f.read().split()]
    return children


def is_running(pid: int) -> bool:
    """False once ``pid`` has exited, even while its zombie waits to be reaped."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rpartition(")")[2].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


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


def local_nodes_rendezvous(nodes: int) -> list[str]:
    """torchrun flags for ``nodes`` launches on this machine that meet over c10d on 127.0.0.1
    (a port free now), as separate nodes would."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return ["--nnodes", str(nodes), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "t"]


def run_together(command: list[str], copies: int, timeout: float) -> list[subprocess.CompletedProcess]:
    """Start ``copies`` of ``command`` at once (one per simulated node) and wait for all of them;
    any still running when one fails or times out is stopped."""
    processes = [start(command) for _ in range(copies)]
    try:
        return [finish(process, timeout=timeout) for process in processes]
    finally:
        for process in processes:
            if process.poll() is None:
                stop(process)


def run_training(
    config: str,
    overrides: list[str],
    nproc: int = 2,
    timeout: float = 300,
    check: bool = True,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess:
    """Run to completion; with ``check``, raise with the log's tail if it failed."""
    result = finish(start(torchrun_command(config, overrides, nproc), env=env), timeout)
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


def read_checkpoint(path: str) -> dict[str, object]:
    """Every entry of the DCP checkpoint folder ``path``, read in this process (no process group):
    ``{"optimizer/state.layers.0.attention.wq.weight.momentum_buffer": tensor, ...}``, the
    sharded tensors whole. For comparing two checkpoints entry by entry."""
    import tempfile

    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as scratch:
        whole = os.path.join(scratch, "checkpoint.pt")
        dcp_to_torch_save(path, whole)
        loaded = torch.load(whole, weights_only=False)

    flat: dict[str, object] = {}

    def walk(prefix: str, value) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                walk(f"{prefix}/{key}" if prefix else str(key), item)
        else:
            flat[prefix] = value

    walk("", loaded)
    return flat
