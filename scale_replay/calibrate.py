"""The replay's Newton–Schulz cost model against NS measured on a GPU.

Reads the rows ``scripts/ns_gram_crossover.py --json`` wrote on a GPU (default: the H100 run in
docs/gpu/h100_2026-11-27/crossover.json), traces the same ``orthogonalize`` calls on meta with the
step trace's recorder (scale_replay/step_trace.py), and costs them as the replay does
(scale_replay/replay.py ``Hardware``: each kernel at least ``min_kernel_s``, matrix products at the bf16
rate, passes at the memory rate, each kernel launched by the host in ``launch_s``, one stream).
Prints modelled and measured time per call and their ratio, and the host time per kernel the
launch-bound rows imply.

    python scripts/calibrate_replay.py [--rows docs/gpu/h100_2026-11-27/crossover.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import replace
from pathlib import Path
from unittest import mock

import torch


from scale_replay.replay import Hardware, replay  # noqa: E402
from scale_replay.step_trace import Trace, trace_kernels  # noqa: E402

from titan_muon.algorithm import newton_schulz  # noqa: E402
from titan_muon.algorithm.newton_schulz import orthogonalize  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = {  # measured column: (compute dtype, algorithm, split the symmetric products as measured)
    "standard_ms": (torch.bfloat16, "standard", True),
    "gram_ms": (torch.float16, "gram", True),
    "gram_no_split_ms": (torch.float16, "gram", False),
}
MEASURED_SPLIT_MIN = 512  # the crossover run split symmetric products from 512 rows on


def modelled_seconds(hardware: Hardware, batch: int, m: int, n: int, dtype: torch.dtype, algorithm: str, split: bool) -> tuple[float, int]:
    """(seconds, kernels) of one orthogonalize call, replayed by scale_replay/replay.py as one rank's trace."""
    shape = (batch, m, n) if batch > 1 else (m, n)
    split_min = MEASURED_SPLIT_MIN if split else 1 << 30
    with mock.patch.object(newton_schulz, "symmetric_split_min", lambda device_type: split_min):
        kernels = trace_kernels(lambda: orthogonalize(torch.empty(*shape, device="meta"), 5, "polar_express", dtype, algorithm=algorithm))
    return replay([Trace(0, kernels)], hardware)[0].finish_s, len(kernels)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=Path, default=ROOT / "docs" / "gpu" / "h100_2026-11-27" / "crossover.json")
    args = parser.parse_args()
    hardware = Hardware()
    rows = json.loads(args.rows.read_text())
    for dtype, algorithm, _ in VARIANTS.values():  # fills half_precision_peak's cache outside the traces
        orthogonalize(torch.empty(2, 8, device="meta"), 5, "polar_express", dtype, algorithm=algorithm)
    print(f"Measured: {args.rows.relative_to(ROOT) if args.rows.is_relative_to(ROOT) else args.rows}. Model: scale_replay/replay.py Hardware() "
          f"(bf16 matmuls {hardware.bf16_matmul_flops / 1e12:.0f} TFLOP/s, memory {hardware.memory_bytes_per_s / 1e12:.2f} TB/s, "
          f"launch {hardware.launch_s * 1e6:.0f} µs, kernel ≥ {hardware.min_kernel_s * 1e6:.0f} µs).\n")
    print("| m × n | batch | variant | kernels | modelled ms | measured ms | measured / modelled |")
    print("|---|---|---|---|---|---|---|")
    ratios: dict[str, list[tuple[int, float]]] = {name: [] for name in VARIANTS}
    host_per_kernel = []
    for row in rows:
        for name, (dtype, algorithm, split) in VARIANTS.items():
            seconds, kernels = modelled_seconds(hardware, row["batch"], row["m"], row["n"], dtype, algorithm, split)
            measured = row[name] / 1e3
            ratios[name].append((row["m"], measured / seconds))
            if row["batch"] == 1 and row["m"] <= 1024 and name == "standard_ms":
                host_per_kernel.append(measured / kernels)
            print(f"| {row['m']} × {row['n']} | {row['batch']} | {name.removesuffix('_ms')} | {kernels} | {1e3 * seconds:.3f} | "
                  f"{1e3 * measured:.3f} | {measured / seconds:.2f} |")
    print()
    for name, pairs in ratios.items():
        large = [r for m, r in pairs if m >= 2048]
        small = [r for m, r in pairs if m <= 1024]
        print(f"- {name.removesuffix('_ms')}: measured / modelled, median {statistics.median(large):.2f} (range {min(large):.2f}–{max(large):.2f}) "
              f"from a short side of 2048, {statistics.median(small):.2f} ({min(small):.2f}–{max(small):.2f}) up to 1024.")
    if host_per_kernel:
        launch = statistics.median(host_per_kernel)
        print(f"- Standard NS alone, short side ≤ 1024 (launch-bound): {1e6 * launch:.1f} µs per kernel measured "
              f"(the model's launch: {hardware.launch_s * 1e6:.0f} µs).")
        refit = replace(hardware, launch_s=launch)
        for name, (dtype, algorithm, split) in VARIANTS.items():
            small = [row[name] / 1e3 / modelled_seconds(refit, row["batch"], row["m"], row["n"], dtype, algorithm, split)[0]
                     for row in rows if row["m"] <= 1024]  # fmt: skip
            print(f"  With that launch time, {name.removesuffix('_ms')} up to 1024: measured / modelled median {statistics.median(small):.2f} "
                  f"({min(small):.2f}–{max(small):.2f}).")
