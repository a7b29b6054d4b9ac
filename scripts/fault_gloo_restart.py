"""Why torchrun --max-restarts could not re-form a gloo group: plain torch, no torchtitan.

    python scripts/fault_gloo_restart.py             # shared store (torchrun's default): restart fails
    python scripts/fault_gloo_restart.py --fresh     # TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: restart works

Launches itself under ``torchrun --standalone --nproc-per-node 2 --max-restarts 1``. Each
worker prints the keys it finds in torchrun's store, forms a gloo group and all-reduces; in
the first attempt rank 1 then SIGKILLs itself. In the second attempt rank 1 waits 3 s before
joining, so that rank 0 reads the store first: with the shared store it finds rank 1's
address from the first attempt (key ``default_pg/0//cpu//0/1``), connects to a dead port
and fails with "Gloo connectFullMesh failed ... Connection refused". Exit status 0 means
the restarted group formed and all-reduced.
"""

import os
import signal
import subprocess
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist


def launch(fresh_store: bool, timeout: float = 180) -> subprocess.CompletedProcess:
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1" if fresh_store else "0"}
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "--max-restarts", "1", __file__, "--worker",
    ]  # fmt: skip
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)


def worker() -> None:
    attempt, rank = int(os.environ["TORCHELASTIC_RESTART_COUNT"]), int(os.environ["RANK"])
    if os.environ["TORCHELASTIC_USE_AGENT_STORE"] == "True":  # torchrun's store, shared by all attempts
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
        keys = sorted(store.list_keys())
    else:
        keys = "a fresh store, hosted by rank 0"
    print(f"attempt {attempt} rank {rank}: store holds {keys}", flush=True)
    if attempt == 1 and rank == 1:
        time.sleep(3)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    total = torch.ones(1)
    dist.all_reduce(total)
    print(f"attempt {attempt} rank {rank}: group formed, all_reduce = {total.item()}", flush=True)
    if attempt == 0 and rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    if attempt == 0:
        time.sleep(60)  # rank 0 waits here until torchrun stops it for the restart
    dist.destroy_process_group()


if __name__ == "__main__":
    if "--worker" in sys.argv:
        worker()
    else:
        result = launch(fresh_store="--fresh" in sys.argv)
        log = result.stdout + result.stderr
        print("\n".join(line for line in log.splitlines() if "attempt" in line or "connectFullMesh" in line))
        print(f"torchrun exit status: {result.returncode}")
        sys.exit(result.returncode)
