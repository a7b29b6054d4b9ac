"""Faults under torchrun on CPU/gloo: a killed rank, a crash mid-save, a full or unwritable
disk, SIGTERM; plus the pre-resume checks of checkpoint.initial_load_path in one process.

Faults are injected by tests/fixtures/fault_train.py (titan_muon.torchtitan.train plus one fault chosen by an
environment variable). Every launch has a timeout; runs use the tiny flavor and 12 steps,
checkpoints every 3. Losses are compared bit for bit with one uninterrupted run: a resume
restores every state (weights, optimizer, lr schedule, data position, RNG seed) and the
same 2 ranks with the same thread count do the same float operations in the same order
(tests/test_torchtitan_train.py::test_resume_continues_exactly_like_the_straight_run).
"""

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed.checkpoint as dcp
from distributed import tiny_run_flags, trainer_flags
from torchtitan.config import Checkpoint as CheckpointConfig

from titan_muon.torchtitan.checkpoint import CheckpointError, check_before_resume
from titan_muon.torchtitan.harness import (
    REPO_ROOT,
    child_pids,
    finish,
    is_running,
    read_losses,
    start,
    stop,
    torchrun_command,
    wait_for_log,
)  # fmt: skip
from titan_muon.torchtitan.train import check_restarts_can_rendezvous

MUON = "train_configs/llama3_gqa_muon.toml"
FAULT_TRAIN = ("tests/fixtures/fault_train.py",)
STEPS, INTERVAL = 12, 3
RUN_TIMEOUT = 400  # seconds; a run takes ~20 s on an idle 2-core machine, minutes on a busy one


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("faults")


def tiny(workdir: Path, dump: str, *extra: str) -> list[str]:
    return [
        *tiny_run_flags(workdir, dump, STEPS), "--checkpoint.enable", "--checkpoint.interval", str(INTERVAL),
        "--checkpoint.no-last-save-model-only", *trainer_flags(), *extra,
    ]  # fmt: skip


def launch(workdir: Path, dump: str, *extra: str, fault: dict[str, str] | None = None, max_restarts: int = 0):
    """Run to the end (or failure) with a log file; returns (exit status, log text)."""
    entry = FAULT_TRAIN if fault else ("-m", "titan_muon.torchtitan.train")
    command = torchrun_command(MUON, tiny(workdir, dump, *extra), max_restarts=max_restarts, entry=entry)
    log_file = str(workdir / f"{dump}.log")
    result = finish(start(command, env=fault, log_file=log_file), timeout=RUN_TIMEOUT)
    return result.returncode, Path(log_file).read_text()


@pytest.fixture(scope="module")
def reference(workdir) -> dict[int, float]:
    code, log = launch(workdir, "reference")
    assert code == 0, log[-6000:]
    losses = read_losses(str(workdir / "reference"))
    assert sorted(losses) == list(range(1, STEPS + 1))
    return losses


def complete(checkpoint: Path) -> bool:
    return (checkpoint / ".metadata").is_file()


@pytest.mark.timeout(2 * RUN_TIMEOUT + 60)
def test_kill_9_of_one_rank_restarts_and_resumes_exactly(reference, workdir):
    """SIGKILL rank 1 after step 7 under torchrun --max-restarts 1: the group is restarted,
    resumes from step-6 and ends with the uninterrupted run's losses."""
    code, log = launch(workdir, "killed", fault={"FAULT_KILL_AFTER_STEP": "7", "FAULT_MARKER_DIR": str(workdir)},
                       max_restarts=1)  # fmt: skip
    assert code == 0, log[-6000:]
    # Rank 1 really died of SIGKILL and the group was restarted for it. (torchrun names only the
    # failure it saw first, by timestamp: under load rank 0, losing its peer, may come first.)
    assert (workdir / "rank1-sigkill").is_file()
    assert re.search(r"failed \(exitcode: (-9\) local_rank: 1|1\) local_rank: 0)", log)
    assert f"Loading the checkpoint from {workdir / 'killed' / 'checkpoint' / 'step-6'}." in log
    assert "Training starts at step 7" in log
    # The first attempt logged steps 1..7, the restarted one 7..12 (later runs win in read_losses).
    assert read_losses(str(workdir / "killed")) == reference


@pytest.mark.timeout(2 * RUN_TIMEOUT + 60)
def test_crash_while_saving_resumes_from_the_previous_checkpoint(reference, workdir):
    """SIGKILL rank 1 in the middle of writing its shard of step-6; the next start names the
    incomplete folder, resumes from step-3 and continues exactly like the uninterrupted run."""
    code, log = launch(workdir, "torn", fault={"FAULT_KILL_IN_SAVE": "6"})
    assert code != 0
    checkpoints = workdir / "torn" / "checkpoint"
    torn_shard, whole_shard = checkpoints / "step-6" / "__1_0.distcp", workdir / "reference/checkpoint/step-6/__1_0.distcp"
    assert complete(checkpoints / "step-3") and not complete(checkpoints / "step-6")
    assert 0 < torn_shard.stat().st_size < whole_shard.stat().st_size

    code, log = launch(workdir, "torn")
    assert code == 0, log[-6000:]
    assert f"Skipping incomplete checkpoint(s) ['{checkpoints / 'step-6'}']" in log
    assert f"Loading the checkpoint from {checkpoints / 'step-3'}." in log
    assert "Training starts at step 4" in log
    assert read_losses(str(workdir / "torn")) == reference
    assert complete(checkpoints / "step-6")  # saved again, whole


@pytest.mark.timeout(RUN_TIMEOUT + 60)
def test_sigterm_to_torchrun_stops_every_worker_without_a_hang(workdir):
    """Preemption: SIGTERM to torchrun while rank 1 is stalled after step 7 and rank 0 waits
    for it inside a collective. torchrun forwards SIGTERM to its workers (SIGKILL after its
    30 s shutdown timeout); torchtitan does not catch it, so nothing is saved on the way out
    and step-6 is the checkpoint to resume from (resuming it: the kill -9 test above; the
    whole sequence: scripts/fault_scenarios.py)."""
    log_file = str(workdir / "preempted.log")
    command = torchrun_command(MUON, tiny(workdir, "preempted"), entry=FAULT_TRAIN)
    torchrun = start(command, env={"FAULT_PAUSE_AFTER_STEP": "7"}, log_file=log_file)
    try:
        wait_for_log(log_file, "step:  7  loss", torchrun, timeout=RUN_TIMEOUT)
        workers = child_pids(torchrun.pid)
        assert len(workers) == 2
        sent = time.monotonic()
        torchrun.send_signal(signal.SIGTERM)
        torchrun.wait(timeout=60)  # torchrun's 30 s grace before SIGKILL, plus slack for a loaded machine
        elapsed = time.monotonic() - sent
    finally:
        if torchrun.poll() is None:
            stop(torchrun)
    assert torchrun.returncode != 0
    assert not any(is_running(pid) for pid in workers)
    checkpoints = workdir / "preempted" / "checkpoint"
    assert sorted(os.listdir(checkpoints)) == ["step-3", "step-6"]
    assert complete(checkpoints / "step-3") and complete(checkpoints / "step-6")
    print(f"torchrun and its workers exited {elapsed:.1f} s after SIGTERM")


@pytest.mark.timeout(RUN_TIMEOUT + 60)
def test_unwritable_checkpoint_folder_fails_clearly_on_every_rank(workdir):
    """The checkpoint folder lies under a regular file: mkdir fails with ENOTDIR even for
    root (chmod does not stop root), on both ranks; the run stops with one error naming it."""
    blocker = workdir / "unwritable" / "blocker"
    blocker.parent.mkdir()
    blocker.write_text("a file where a folder should be")
    folder = blocker / "checkpoint"
    code, log = launch(workdir, "unwritable", "--checkpoint.folder", str(folder), "--training.steps", "4")
    assert code != 0
    assert f"checkpoint I/O under {folder} failed" in log
    # DCP gathers every rank's failure and raises them all on every rank.
    assert f"rank(s) [0, 1]: NotADirectoryError: [Errno 20] Not a directory: '{folder / 'step-3'}'" in log


def mount_tmpfs(path: Path, size: str) -> bool:
    path.mkdir(parents=True)
    command = ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)]
    return shutil.which("mount") is not None and subprocess.run(command, capture_output=True).returncode == 0


@pytest.mark.timeout(RUN_TIMEOUT + 60)
def test_disk_full_while_saving_keeps_the_previous_checkpoint(reference, workdir):
    """A 6 MiB tmpfs holds one checkpoint (4.6 MB) but not two: the save of step-6 fails with
    ENOSPC part-way. The run stops with an error naming the folder, and step-3 stays byte for
    byte what the uninterrupted run wrote (resuming past such a torn step-6: the crash test
    above; on this disk: scripts/fault_scenarios.py)."""
    disk = workdir / "small_disk"
    if not mount_tmpfs(disk, "6m"):
        pytest.skip("cannot mount a tmpfs here (needs root and CAP_SYS_ADMIN)")
    try:
        folder = disk / "checkpoint"
        code, log = launch(workdir, "disk_full", "--checkpoint.folder", str(folder))
        assert code != 0
        assert f"checkpoint I/O under {folder} failed" in log
        assert "No space left on device" in log, log[-3000:]
        assert f"the newest complete one, {folder / 'step-3'}, is untouched" in log
        assert complete(folder / "step-3") and not complete(folder / "step-6")
        straight = workdir / "reference" / "checkpoint" / "step-3"
        for name in ("__0_0.distcp", "__1_0.distcp"):  # same state, same bytes (.metadata holds the path)
            assert (folder / "step-3" / name).read_bytes() == (straight / name).read_bytes(), name
    finally:
        subprocess.run(["umount", str(disk)], check=True)


@pytest.mark.timeout(200)
def test_torchrun_shared_store_keeps_the_dead_workers_gloo_addresses():
    """The root cause of the failed restarts, in plain torch (tests/fixtures/fault_gloo_restart.py):
    after torchrun restarts its workers, its shared store still holds the gloo addresses the
    killed attempt published, which the new workers may read. (The fix, a fresh store per
    restart, is what the kill -9 test above runs with.)"""
    script = str(REPO_ROOT / "tests" / "fixtures" / "fault_gloo_restart.py")
    shared = subprocess.run([sys.executable, script, "--keys-only"], capture_output=True, text=True, timeout=190)
    stale = "['default_pg/0//cpu//0/0', 'default_pg/0//cpu//0/1']"
    assert f"attempt 1 rank 0: store holds {stale}" in shared.stdout, shared.stdout
    assert f"attempt 1 rank 1: store holds {stale}" in shared.stdout, shared.stdout


def test_restarts_over_a_shared_store_are_refused_before_training():
    shared = {"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_MAX_RESTARTS": "1"}
    with pytest.raises(RuntimeError, match="TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"):
        check_restarts_can_rendezvous(shared)
    check_restarts_can_rendezvous({**shared, "TORCHELASTIC_MAX_RESTARTS": "0"})
    check_restarts_can_rendezvous({**shared, "TORCHELASTIC_USE_AGENT_STORE": "False"})
    check_restarts_can_rendezvous({})  # not under torchrun


# checkpoint.initial_load_path: the same checks as the dump folder's checkpoints, in one process.


class Holder:
    """Stands in for torchtitan's model / optimizer wrappers: anything with state_dict()."""

    def __init__(self, state: dict[str, torch.Tensor]):
        self.state = state

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.state


def run_states(rows: int = 4) -> dict[str, Holder]:
    weight = torch.arange(rows * 3, dtype=torch.float32).reshape(rows, 3)
    return {
        "model": Holder({"layer.weight": weight}),
        "optimizer": Holder({"state.layer.weight.momentum_buffer": torch.zeros(rows, 3)}),
    }


def save(path: Path, states: dict[str, Holder], with_optimizer: bool = True) -> Path:
    flat = {**states["model"].state_dict(), **({"optimizer": states["optimizer"].state_dict()} if with_optimizer else {})}
    dcp.save(flat, checkpoint_id=str(path), no_dist=True)
    return path


def check_initial(tmp_path: Path, path: Path, states=None, **config) -> None:
    checkpoint_config = CheckpointConfig(enable=True, initial_load_path=str(path), **config)
    checkpointer = SimpleNamespace(folder=str(tmp_path / "dump" / "checkpoint"), states=states or run_states())
    check_before_resume(checkpointer, checkpoint_config)


def test_initial_load_path_gets_the_pre_resume_checks(tmp_path):
    good = save(tmp_path / "good" / "step-10", run_states())
    check_initial(tmp_path, good)
    check_initial(tmp_path, good, initial_load_model_only=False)

    (tmp_path / "incomplete").mkdir()
    shutil.copytree(good, tmp_path / "incomplete" / "step-10")
    (tmp_path / "incomplete" / "step-10" / ".metadata").unlink()
    with pytest.raises(CheckpointError, match="initial_load_path .*incomplete/step-10 is not a complete DCP checkpoint"):
        check_initial(tmp_path, tmp_path / "incomplete" / "step-10")
    with pytest.raises(CheckpointError, match="not a complete DCP checkpoint.*parent folder"):
        check_initial(tmp_path, tmp_path / "good")  # the folder above step-10

    truncated = shutil.copytree(good, tmp_path / "truncated")
    shard = next(truncated.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-8])
    with pytest.raises(CheckpointError, match=f"{truncated}: shard {shard.name} is truncated"):
        check_initial(tmp_path, truncated)

    with pytest.raises(CheckpointError, match=r"(?s)does not fit this model.*saved shape \(4, 3\), this model has \(5, 3\)"):
        check_initial(tmp_path, good, states=run_states(rows=5))

    model_only = save(tmp_path / "model_only", run_states(), with_optimizer=False)
    check_initial(tmp_path, model_only)  # initial_load_model_only (torchtitan's default) needs no optimizer
    with pytest.raises(CheckpointError, match="holds no optimizer state"):
        check_initial(tmp_path, model_only, initial_load_model_only=False)


def test_initial_load_path_is_not_silently_dropped_for_a_folder_of_interrupted_saves(tmp_path):
    """torchtitan ignores initial_load_path once the checkpoint folder exists; if that folder
    holds only interrupted saves, it would start from scratch instead of from the path."""
    good = save(tmp_path / "good" / "step-10", run_states())
    (tmp_path / "dump" / "checkpoint" / "step-3").mkdir(parents=True)  # a first save that was killed
    with pytest.raises(CheckpointError, match="holds no complete checkpoint.*would ignore checkpoint.initial_load_path"):
        check_initial(tmp_path, good)


def test_a_pipeline_stage_checks_only_its_own_parameters(tmp_path):
    """Under pipeline parallel each rank's optimizer holds one stage's parameters and the
    checkpoint every stage's: the others' state is no sign of a changed setup (resuming under
    PP was refused before), but a change to this stage's parameters still is."""

    def states(optimizer_state: dict[str, torch.Tensor]) -> dict[str, Holder]:
        model = {name.removeprefix("state.").rsplit(".", 1)[0]: torch.ones(2, 2) for name in optimizer_state}
        return {"model": Holder(model), "optimizer": Holder(optimizer_state)}

    folder = tmp_path / "dump" / "checkpoint"
    whole = {f"state.{name}.weight.momentum_buffer": torch.zeros(2, 2) for name in ("a", "b")}
    save(folder / "step-10", states(whole))
    config = CheckpointConfig(enable=True)
    stage = SimpleNamespace(folder=str(folder), states=states({"state.a.weight.momentum_buffer": torch.zeros(2, 2)}))
    other_stage = r"b\.weight: checkpoint has \['momentum_buffer'\], this run expects nothing"
    with pytest.raises(CheckpointError, match=other_stage):
        check_before_resume(stage, config)
    check_before_resume(stage, config, pipeline_stage=True)
    moved = SimpleNamespace(folder=str(folder), states=states({"state.a.weight.exp_avg": torch.zeros(2, 2)}))
    changed = r"a\.weight: checkpoint has \['momentum_buffer'\], this run expects \['exp_avg'\]"
    with pytest.raises(CheckpointError, match=changed):
        check_before_resume(moved, config, pipeline_stage=True)
