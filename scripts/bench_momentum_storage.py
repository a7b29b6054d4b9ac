"""Time Muon momentum storage (store + load of one shard) side by side: fp8 vs bf16 vs fp32.

    python scripts/bench_momentum_storage.py                    # a 4096 x 14336 shard, 5 rounds
    python scripts/bench_momentum_storage.py --rows 1024 --repeats 9

Each round runs every storage once, in turn, so machine load hits them alike; the table
gives the median over rounds and the ratio to bf16 (goal: fp8 <= 1.5x bf16). One store +
load is what the optimizer does per Muon matrix per step: ``store(state, m)`` then
``load(state)`` (a fresh fp32 tensor; for fp32 the buffer itself).

It also times the stochastic-rounding noise alone and fp8 store + load, in ns per element,
side by side with the previous implementation (noise from a seeded CPU torch.Generator per
64 K elements, Python loops per column block), loaded from git revision --baseline, on a
--baseline-rows slice of the shard (the old code is slow). Large CPU allocations pay page faults; set THP_MEM_ALLOC_ENABLE=1 to
let torch's CPU allocator use transparent huge pages (the header says which).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

sys.path.insert(0, str(REPO / "scripts"))
from bench_optimizer import cpu_name  # noqa: E402
from titan_muon.state.momentum import momentum_storage, rounding_noise  # noqa: E402

STORAGES = {
    "fp32": dict(momentum_dtype="fp32"),
    "bf16": dict(momentum_dtype="bf16"),
    "bf16 stochastic": dict(momentum_dtype="bf16", rounding="stochastic"),
    "fp8": dict(momentum_dtype="fp8"),
    "fp8 nearest": dict(momentum_dtype="fp8", rounding="nearest"),
}


def seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def store_and_load(storage, state, momentum):
    def run():
        storage.store(state, momentum, stream=0)
        storage.load(state)

    return run


def time_storages(rows: int, cols: int, repeats: int) -> dict[str, float]:
    momentum = torch.randn(rows, cols, generator=torch.Generator().manual_seed(0))
    runs = {}
    for name, kwargs in STORAGES.items():
        storage = momentum_storage(**kwargs)
        runs[name] = store_and_load(storage, storage.create(torch.zeros(rows, cols)), momentum)
        runs[name]()  # warm-up
    times = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            times[name].append(seconds(run))
    return {name: statistics.median(t) for name, t in times.items()}


def load_baseline(revision: str):
    """The momentum storage module as of `revision` (titan_muon/state/momentum.py, titan_muon/state.py
    before the folders of wave 4), imported as a separate module."""
    for path in ("titan_muon/state/momentum.py", "titan_muon/state.py"):
        shown = subprocess.run(["git", "-C", str(REPO), "show", f"{revision}:{path}"], capture_output=True, text=True)
        if shown.returncode == 0:
            break
    shown.check_returncode()
    source = shown.stdout.replace("from titan_muon.update import", "from titan_muon.algorithm.update import")  # moved since
    path = Path(tempfile.mkdtemp()) / "baseline_state.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("baseline_state", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def time_against_baseline(rows: int, cols: int, revision: str, repeats: int) -> dict[str, float] | None:
    """ns per element on a (rows, cols) shard, side by side: noise alone and fp8 store + load,
    now and at git revision `revision` (None if git cannot provide it)."""
    try:
        baseline = load_baseline(revision)
    except (subprocess.CalledProcessError, FileNotFoundError) as error:
        print(f"(no baseline: {error})")
        return None
    step, like = torch.tensor(1), torch.empty(rows, cols, dtype=torch.uint8)
    momentum = torch.randn(rows, cols, generator=torch.Generator().manual_seed(0))
    new_fp8, old_fp8 = momentum_storage("fp8"), baseline.momentum_storage("fp8")
    runs = {
        "noise": lambda: rounding_noise(step, 0, 0, (rows, cols), 20, "cpu"),
        "baseline noise": lambda: baseline._noise(1, 0, like, 20),
        "fp8": store_and_load(new_fp8, new_fp8.create(torch.zeros(rows, cols)), momentum),
        "baseline fp8": store_and_load(old_fp8, old_fp8.create(torch.zeros(rows, cols)), momentum),
    }
    times = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            times[name].append(seconds(run))
    return {name: 1e9 * statistics.median(t) / (rows * cols) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--cols", type=int, default=14336)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--baseline", default="c8ab4b3", help="git revision of the previous state.py")
    parser.add_argument("--baseline-rows", type=int, default=512)
    args = parser.parse_args()

    print(f"Command: python scripts/bench_momentum_storage.py {' '.join(sys.argv[1:])}".strip())
    huge_pages = os.environ.get("THP_MEM_ALLOC_ENABLE", "0")
    print(f"{cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}, THP_MEM_ALLOC_ENABLE={huge_pages}, {datetime.date.today()}")
    print(f"shard {args.rows} x {args.cols} fp32 ({args.rows * args.cols * 4 / 2**20:.0f} MiB), median of {args.repeats} rounds\n")

    medians = time_storages(args.rows, args.cols, args.repeats)
    print("| storage | store + load (s) | vs bf16 | ns / element |")
    print("|---|---|---|---|")
    for name, t in medians.items():
        print(f"| {name} | {t:.3f} | {t / medians['bf16']:.2f}x | {1e9 * t / (args.rows * args.cols):.1f} |")

    ns = time_against_baseline(args.baseline_rows, args.cols, args.baseline, args.repeats)
    if ns is not None:
        print(f"\n{args.baseline_rows} x {args.cols} shard, ns / element, now vs {args.baseline} (median of {args.repeats} rounds):\n")
        print(f"| | now | {args.baseline} | speed-up |")
        print("|---|---|---|---|")
        for name, label in [("noise", "stochastic-rounding noise alone"), ("fp8", "fp8 store + load")]:
            old = ns[f"baseline {name}"]
            print(f"| {label} | {ns[name]:.1f} | {old:.1f} | {old / ns[name]:.1f}x |")

if __name__ == "__main__":
    main()
