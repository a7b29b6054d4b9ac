"""Time Muon momentum storage (store + load of one shard) side by side: fp8 vs bf16 vs fp32.

    python scripts/bench_momentum_storage.py                    # a 4096 x 14336 shard, 5 rounds
    python scripts/bench_momentum_storage.py --rows 1024 --repeats 9

Each round runs every storage once, in turn, so machine load hits them alike; the table
gives the median over rounds and the ratio to bf16 (goal: fp8 <= 1.5x bf16). One store +
load is what the optimizer does per Muon matrix per step: ``store(state, m)`` then
``load(state)`` (a fresh fp32 tensor; for fp32 the buffer itself).

It also times the stochastic-rounding noise alone, in ns per element, against the previous
implementation (a seeded CPU torch.Generator per 64 K elements), which is loaded from git
revision --baseline (on --baseline-rows rows, as it is slow).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from titan_muon.state import momentum_storage, rounding_noise  # noqa: E402

STORAGES = {
    "fp32": dict(momentum_dtype="fp32"),
    "bf16": dict(momentum_dtype="bf16"),
    "bf16 stochastic": dict(momentum_dtype="bf16", rounding="stochastic"),
    "fp8": dict(momentum_dtype="fp8"),
    "fp8 nearest": dict(momentum_dtype="fp8", rounding="nearest"),
}


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


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
    """titan_muon/state.py as of `revision`, imported as a separate module."""
    source = subprocess.run(
        ["git", "-C", str(REPO), "show", f"{revision}:titan_muon/state.py"], check=True, capture_output=True, text=True
    ).stdout
    path = Path(tempfile.mkdtemp()) / "baseline_state.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("baseline_state", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def time_noise(rows: int, cols: int, baseline_rows: int, revision: str, repeats: int) -> tuple[float, float | None]:
    """ns per element: the hash noise on (rows, cols), the baseline's generator on (baseline_rows, cols)."""
    step = torch.tensor(1)
    new = statistics.median(seconds(lambda: rounding_noise(step, 0, 0, (rows, cols), 20, "cpu")) for _ in range(repeats))
    try:
        baseline = load_baseline(revision)
    except (subprocess.CalledProcessError, FileNotFoundError) as error:
        print(f"(no baseline: {error})")
        return 1e9 * new / (rows * cols), None
    like = torch.empty(baseline_rows, cols, dtype=torch.uint8)
    old = statistics.median(seconds(lambda: baseline._noise(1, 0, like, 20)) for _ in range(max(1, repeats // 2)))
    return 1e9 * new / (rows * cols), 1e9 * old / (baseline_rows * cols)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--cols", type=int, default=14336)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--baseline", default="c8ab4b3", help="git revision of the previous state.py")
    parser.add_argument("--baseline-rows", type=int, default=512)
    args = parser.parse_args()

    print(f"Command: python scripts/bench_momentum_storage.py {' '.join(sys.argv[1:])}".strip())
    print(f"{cpu_model()}, {torch.get_num_threads()} threads, torch {torch.__version__}, {datetime.date.today()}")
    print(f"shard {args.rows} x {args.cols} fp32 ({args.rows * args.cols * 4 / 2**20:.0f} MiB), median of {args.repeats} rounds\n")

    medians = time_storages(args.rows, args.cols, args.repeats)
    print("| storage | store + load (s) | vs bf16 | ns / element |")
    print("|---|---|---|---|")
    for name, t in medians.items():
        print(f"| {name} | {t:.3f} | {t / medians['bf16']:.2f}x | {1e9 * t / (args.rows * args.cols):.1f} |")

    new, old = time_noise(args.rows, args.cols, args.baseline_rows, args.baseline, args.repeats)
    print(f"\nstochastic-rounding noise alone: hash {new:.2f} ns/element", end="")
    if old is not None:
        print(f"; generator at {args.baseline} {old:.2f} ns/element ({args.baseline_rows} rows): {old / new:.0f}x")
    else:
        print()


if __name__ == "__main__":
    main()
