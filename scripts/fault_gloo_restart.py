"""Why torchrun --max-restarts could not re-form a gloo group: plain torch, no torchtitan.

    python scripts/fault_gloo_restart.py               # shared store (torchrun's default)
    python scripts/fault_gloo_restart.py --fresh       # TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: restart works
    python scripts/fault_gloo_restart.py --keys-only   # only print the store's keys after the restart

Launches itself under ``torchrun --standalone --nproc-per-node 2 --max-restarts 1``. Each
worker prints the keys it finds in torchrun's store, forms a gloo group and all-reduces; in
the first attempt rank 1 then SIGKILLs itself. After the restart the shared store still holds
both ranks' gloo addresses from the first attempt (keys ``default_pg/0//cpu//0/<rank>``). Rank
1 joins only once rank 0 has published its new address, so rank 0 reads rank 1's dead one.
What follows depends on which side of the gloo pair connects (it varies from run to run):
"Gloo connectFullMesh failed ... Connection refused", a hang, or, when rank 1 connects, a
working group. Exit status 0 means the restarted group formed and all-reduced.
"""

import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from titan_muon.torchtitan.harness import finish, start  # noqa: E402

RANK_0_ADDRESS = "default_pg/0//cpu//0/0"  # where gloo publishes rank 0's address


def launch(fresh_store: bool, keys_only: bool = False, timeout: float = 180) -> subprocess.CompletedProcess:
    """torchrun with this file as workers; past ``timeout``, torchrun and its workers are stopped."""
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "--max-restarts", "1", __file__, "--worker", *(["--keys-only"] if keys_only else []),
    ]  # fmt: skip
    env = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1" if fresh_store else "0"}
    return finish(start(command, env=env), timeout)


def wait_until_republished(store: dist.TCPStore, key: str, stale: bytes) -> None:
    while not (store.check([key]) and store.get(key) != stale):
        time.sleep(0.05)
    time.sleep(1)  # gloo reads the peers' keys right after publishing its own


def worker(keys_only: bool) -> None:
    attempt, rank = int(os.environ["TORCHELASTIC_RESTART_COUNT"]), int(os.environ["RANK"])
    store = None
    if os.environ["TORCHELASTIC_USE_AGENT_STORE"] == "True":  # torchrun's store, shared by all attempts
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
        keys = sorted(store.list_keys())
    else:
        keys = "a fresh store, hosted by rank 0"
    print(f"attempt {attempt} rank {rank}: store holds {keys}", flush=True)
    if keys_only and attempt == 1:
        return
    if store is not None and attempt == 1 and rank == 1:
        wait_until_republished(store, RANK_0_ADDRESS, stale=store.get(RANK_0_ADDRESS))
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
        worker(keys_only="--keys-only" in sys.argv)
    else:
        result = launch(fresh_store="--fresh" in sys.argv, keys_only="--keys-only" in sys.argv)
        log = result.stdout + result.stderr
        print("\n".join(line for line in log.splitlines() if "attempt" in line or "connectFullMesh" in line))
        print(f"torchrun exit status: {result.returncode}")
        sys.exit(result.returncode)
