"""The fault scenarios of tests/test_faults.py at full size, each against an uninterrupted run.

    python scripts/fault_scenarios.py                          # Llama 3 GQA debug model, Muon and AdamW
    python scripts/fault_scenarios.py --flavor tiny_gqa --steps 12 --configs llama3_gqa_muon

Per config (2 CPU ranks, checkpoint every 3 steps, default 15 steps), each scenario ends by
comparing the losses of all steps with an uninterrupted run (bit for bit):

  kill-9     kill -9 of rank 1 from outside once step 7 is logged, torchrun --max-restarts 1
  torn-save  rank 1 SIGKILLs itself part-way through its shard of step-6; then a new run
  sigterm    SIGTERM to torchrun while rank 1 stalls after step 7; then a new run
  disk-full  checkpoints on a tmpfs with room for one checkpoint; the folder is then moved
             to a disk with room and the run started again (skipped without mount rights)

Prints one line per scenario: PASS/FAIL, seconds, and what was checked. Exit status 1 if any failed.
"""

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from titan_muon.torchtitan.harness import (  # noqa: E402
    child_pids,
    finish,
    read_losses,
    start,
    stop,
    torchrun_command,
    wait_for_log,
)  # fmt: skip

FAULT_TRAIN = ("tests/fixtures/fault_train.py",)
RUN_TIMEOUT = 1200


class Scenarios:
    def __init__(self, config: str, workdir: Path, flavor: str | None, steps: int):
        self.config, self.workdir, self.steps = config, workdir, steps
        self.model = ["--model.flavor", flavor] if flavor else []
        self.launches = 0

    def overrides(self, dump: str, *extra: str) -> list[str]:
        return [
            *self.model, "--training.steps", str(self.steps), "--metrics.log_freq", "1",
            "--metrics.disable_color_printing", "--job.dump_folder", str(self.workdir / dump),
            "--checkpoint.enable", "--checkpoint.interval", "3", "--checkpoint.no-last-save-model-only", *extra,
        ]  # fmt: skip

    def start(self, dump: str, *extra: str, fault=None, max_restarts: int = 0):
        """Start torchrun; returns the process and its own log file."""
        entry = FAULT_TRAIN if fault else ("-m", "titan_muon.torchtitan.train")
        command = torchrun_command(self.config, self.overrides(dump, *extra), max_restarts=max_restarts, entry=entry)
        self.launches += 1
        log_file = str(self.workdir / f"{self.launches:02d}_{dump}.log")
        return start(command, env=fault, log_file=log_file), log_file

    def run(self, dump: str, *extra: str, fault=None, max_restarts: int = 0) -> tuple[int, str]:
        process, log_file = self.start(dump, *extra, fault=fault, max_restarts=max_restarts)
        return finish(process, RUN_TIMEOUT).returncode, Path(log_file).read_text()

    def losses(self, dump: str) -> dict[int, float]:
        return read_losses(str(self.workdir / dump))

    def reference(self) -> dict[int, float]:
        code, log = self.run("reference")
        assert code == 0, log[-4000:]
        return self.losses("reference")

    def kill_9(self) -> str:
        process, log_file = self.start("kill_9", max_restarts=1)
        wait_for_log(log_file, "step:  7  loss", process, RUN_TIMEOUT)
        rank_1 = next(pid for pid in child_pids(process.pid) if environment(pid).get("RANK") == "1")
        os.kill(rank_1, signal.SIGKILL)
        code = finish(process, RUN_TIMEOUT).returncode
        log = Path(log_file).read_text()
        assert code == 0, log[-4000:]
        assert "Loading the checkpoint from" in log, "no resume"
        return "restarted by torchrun, resumed from " + log.split("Loading the checkpoint from ")[1].split()[0].rstrip(".")

    def torn_save(self) -> str:
        code, _ = self.run("torn_save", fault={"FAULT_KILL_IN_SAVE": "6"})
        assert code != 0
        assert not (self.workdir / "torn_save/checkpoint/step-6/.metadata").exists()
        code, log = self.run("torn_save")
        assert code == 0, log[-4000:]
        assert "Skipping incomplete checkpoint(s)" in log and "Training starts at step 4" in log, log[-4000:]
        return "incomplete step-6 skipped with a warning, resumed from step-3"

    def sigterm(self) -> str:
        process, log_file = self.start("sigterm", fault={"FAULT_PAUSE_AFTER_STEP": "7"})
        try:
            wait_for_log(log_file, "step:  7  loss", process, RUN_TIMEOUT)
            sent = time.monotonic()
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=60)
            elapsed = time.monotonic() - sent
        finally:
            if process.poll() is None:
                stop(process)
        code, log = self.run("sigterm")
        assert code == 0, log[-4000:]
        assert "Training starts at step 7" in log, log[-4000:]
        return f"all workers gone {elapsed:.1f} s after SIGTERM; new run resumed from step-6"

    def disk_full(self) -> str:
        disk = Path(tempfile.mkdtemp(prefix="small_disk_", dir=self.workdir))
        size = checkpoint_bytes(self.workdir / "reference/checkpoint/step-3") * 3 // 2  # room for one, not two
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(disk)], capture_output=True)
        if mounted.returncode != 0:
            return "SKIP: cannot mount a tmpfs here"
        try:
            code, log = self.run("disk_full", "--checkpoint.folder", str(disk / "checkpoint"))
            assert code != 0 and "No space left on device" in log and "checkpoint I/O under" in log, log[-4000:]
            shutil.copytree(disk / "checkpoint", self.workdir / "disk_full" / "checkpoint")
        finally:
            subprocess.run(["umount", str(disk)], check=True)
        code, log = self.run("disk_full")
        assert code == 0, log[-4000:]
        assert "Training starts at step 4" in log, log[-4000:]
        return "ENOSPC named the folder; moved, the run resumed from step-3"


def environment(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        pairs = [entry.decode().partition("=") for entry in f.read().split(b"\0") if entry]
    return {key: value for key, _, value in pairs}


def checkpoint_bytes(folder: Path) -> int:
    return sum(file.stat().st_size for file in folder.iterdir())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default="llama3_gqa_muon,llama3_gqa_adamw")
    parser.add_argument("--flavor", default=None, help="model flavor (default: the config's)")
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--only", default="kill_9,torn_save,sigterm,disk_full")
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args()
    root = Path(args.workdir or tempfile.mkdtemp(prefix="fault_scenarios_"))
    failed = False
    for name in args.configs.split(","):
        scenarios = Scenarios(f"train_configs/{name}.toml", root / name, args.flavor, args.steps)
        scenarios.workdir.mkdir(parents=True, exist_ok=True)
        begin = time.monotonic()
        expected = scenarios.reference()
        print(f"{name:18} reference   {time.monotonic() - begin:6.0f} s  {len(expected)} steps", flush=True)
        for scenario in args.only.split(","):
            begin = time.monotonic()
            try:
                what = getattr(scenarios, scenario)()
                if not what.startswith("SKIP"):
                    losses = scenarios.losses(scenario)
                    assert losses == expected, f"losses differ: {losses} vs {expected}"
                    what += "; losses equal the uninterrupted run's"
                verdict = "SKIP" if what.startswith("SKIP") else "PASS"
            except Exception as error:  # report and go on with the next scenario
                verdict, what, failed = "FAIL", f"{type(error).__name__}: {error}"[:600], True
            print(f"{name:18} {scenario:10} {time.monotonic() - begin:6.0f} s  {verdict}  {what}", flush=True)
    print(f"logs and checkpoints under {root}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
