"""Run a function on W gloo ranks in fresh processes, with a hard timeout.

A hang must fail the test, never block CI: the parent waits at most `timeout` seconds,
then kills every rank and raises. Exceptions on any rank come back with their traceback.

Every rank, like the pytest process (tests/conftest.py), applies the suite's settings:
TITAN_MUON_TEST_THREADS=N (intra-op threads per process, default 1) and
TITAN_MUON_TEST_DETERMINISTIC=1 (torch.use_deterministic_algorithms(True)); torchrun
launches of the trainer get both through trainer_flags() and OMP_NUM_THREADS.
"""

from __future__ import annotations

import faulthandler
import os
import socket
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

THREADS_VARIABLE, DETERMINISTIC_VARIABLE = "TITAN_MUON_TEST_THREADS", "TITAN_MUON_TEST_DETERMINISTIC"


def threads_per_process() -> int:
    value = os.environ.get(THREADS_VARIABLE, "1")
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{THREADS_VARIABLE} must be a positive integer, got {value!r}")
    return int(value)


def deterministic_mode() -> bool:
    value = os.environ.get(DETERMINISTIC_VARIABLE, "0")
    if value not in ("0", "1"):
        raise ValueError(f"{DETERMINISTIC_VARIABLE} must be 0 or 1, got {value!r}")
    return value == "1"


def apply_test_settings() -> None:
    """The suite's thread count and determinism mode, for this process."""
    torch.set_num_threads(threads_per_process())
    if deterministic_mode():
        torch.use_deterministic_algorithms(True)


def tiny_run_flags(workdir, dump: str, steps: int, flavor: str = "tiny_gqa") -> list[str]:
    """titan_muon.torchtitan.train flags of the suite's short torchtitan runs: a tiny model, 64-token
    sequences, a loss logged every step, the shared offline tokenizer under `workdir`, and
    output under `workdir / dump`."""
    return [
        "--model.flavor", flavor, "--training.seq_len", "64", "--training.local_batch_size", "2",
        "--training.steps", str(steps), "--lr_scheduler.warmup_steps", "2", "--metrics.log_freq", "1",
        "--metrics.disable_color_printing", "--model.hf_assets_path", str(workdir / "tokenizer"),
        "--job.dump_folder", str(workdir / dump),
    ]  # fmt: skip


def trainer_flags() -> list[str]:
    """The same determinism mode for titan_muon.torchtitan.train under torchrun (torchtitan's own switch);
    the thread count reaches its workers through OMP_NUM_THREADS (tests/conftest.py)."""
    return ["--debug.deterministic"] if deterministic_mode() else []


def one_sequence_corpus(workdir: Path, tokenizer_dir: Path, seq_len: int = 64) -> Path:
    """Text files that each tokenize to exactly one training sequence, all the same.

    Every rank then sees the same batch at every step, whatever the world size and the
    data position, so runs on different numbers of ranks must produce the same losses.
    """
    # tokenizers comes with the torchtitan extra: imported only by the runs that use it
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    source = (Path(__file__).resolve().parents[1] / "titan_muon" / "torchtitan" / "data.py").read_text()
    text = next(source[:n] for n in range(1, len(source)) if len(tokenizer.encode(source[:n]).ids) == seq_len - 1)
    corpus = workdir / "one_sequence"
    corpus.mkdir(exist_ok=True)
    for i in range(40):
        (corpus / f"copy_{i}.txt").write_text(text)
    return corpus


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, fn, args, out_dir: str, timeout: float) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    apply_test_settings()
    # If this rank is still running shortly before the parent gives up, leave its stack behind.
    stacks = open(Path(out_dir, f"stack{rank}.txt"), "w")
    faulthandler.dump_traceback_later(max(1.0, timeout - 5), file=stacks)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        torch.save(result, Path(out_dir, f"result{rank}.pt"))
    except BaseException:
        Path(out_dir, f"error{rank}.txt").write_text(traceback.format_exc())
    finally:
        if dist.is_initialized():
            _keep_store_until_all_finished(rank, world_size, deadline=time.monotonic() + max(1.0, timeout - 10))
            dist.destroy_process_group()


def _keep_store_until_all_finished(rank: int, world_size: int, deadline: float) -> None:
    """Rank 0 hosts the TCPStore: if it exits while other ranks still create process groups (pipeline
    stages finish at different times), they fail with "Broken pipe". Rank 0 waits until every rank
    has got here (or the run's deadline), without a collective, so a failed rank cannot hang it."""
    try:
        store = dist.distributed_c10d._get_default_store()
        store.add("ranks_finished", 1)
        while rank == 0 and store.add("ranks_finished", 0) < world_size and time.monotonic() < deadline:
            time.sleep(0.05)
    except (RuntimeError, dist.DistError):  # the store is gone already: nothing left to keep alive
        pass


# Ranks are forked from a server process that has imported these once: a launch then costs a fraction
# of a second instead of each rank starting an interpreter and importing torch (several seconds on 2
# cores, for each of the suite's hundreds of launches). The server only imports, so every rank still
# starts from a fresh state (no pytest, no test's monkeypatches, no OpenMP pool to fork), as with spawn;
# its environment is pytest's after conftest.py (the thread count, the determinism switch).
PRELOADED = ["torch", "torch.distributed", "torch.distributed.tensor", "titan_muon", "distributed"]


def _rank_context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOADED)
    return ctx


def run_distributed(fn, world_size: int, *args, timeout: float = 300.0) -> list:
    """fn(rank, world_size, *args) on every rank; returns the per-rank results.

    Raises RankError if any rank raised (with every rank's traceback), TimeoutError on a hang.
    `fn` must be importable (a module-level function of a test module).
    """
    ctx = _rank_context()
    with tempfile.TemporaryDirectory() as out_dir:
        port = _free_port()
        procs = [ctx.Process(target=_entry, args=(r, world_size, port, fn, args, out_dir, timeout)) for r in range(world_size)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        if any(p.is_alive() for p in procs):
            for p in procs:
                p.kill()
                p.join()
            stacks = "\n".join(
                f"--- rank {r} ---\n" + (f.read_text() if (f := Path(out_dir, f"stack{r}.txt")).exists() else "(never started)")
                for r in range(world_size)
            )
            raise TimeoutError(f"distributed run of {fn.__name__} on {world_size} ranks hung for more than {timeout}s\n{stacks}")
        errors = {r: Path(out_dir, f"error{r}.txt").read_text() for r in range(world_size) if Path(out_dir, f"error{r}.txt").exists()}
        if errors:
            raise RankError(errors)
        missing = [r for r in range(world_size) if not Path(out_dir, f"result{r}.pt").exists()]
        if missing:
            raise RuntimeError(f"ranks {missing} died without a result (exit codes {[p.exitcode for p in procs]})")
        return [torch.load(Path(out_dir, f"result{r}.pt"), weights_only=False) for r in range(world_size)]


class RankError(Exception):
    def __init__(self, errors: dict[int, str]):
        self.errors = errors
        super().__init__("\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items())))


class GatherAlongSequence(torch.autograd.Function):
    """(B, H, L, D) slices of every rank, concatenated along the sequence in rank order. Backward:
    each rank's slice gets the sum over ranks of the gradients of its keys/values (an all-reduce of
    the whole gradient, then this rank's slice: gloo has no reduce-scatter, and
    torch.distributed.nn's all-to-all fallback gave wrong gradients for these non-contiguous slices)."""

    @staticmethod
    def forward(ctx, local, group):
        ctx.group, ctx.local_len = group, local.shape[2]
        slices = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(slices, local.contiguous(), group=group)
        return torch.cat(slices, dim=2)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        start = dist.get_rank(ctx.group) * ctx.local_len
        return grad[:, :, start : start + ctx.local_len], None


def causal_mask_over_ranks(group, positions: torch.Tensor) -> torch.Tensor:
    """(local queries, all keys) bool: which of every rank's keys (in :class:`GatherAlongSequence`'s
    rank order) each of this rank's queries may attend to causally, from the global positions
    ``positions`` (L,) that context parallel gave this rank's tokens."""
    gathered = [torch.empty_like(positions) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, positions, group=group)
    return torch.cat(gathered)[None, :] <= positions[:, None]
