"""Where fp16 Gram Newton–Schulz is faster than standard bf16 NS on this device: the measurement
behind ``ns_algorithm="auto"`` on CUDA (titan_muon.algorithm.newton_schulz.resolve_algorithm).

For wide matrices (short side m, long side n = aspect·m) in batches of 1 and 8, the median time of
5 Polar Express steps (CUDA events, after warm-up) of: standard NS in bf16; Gram NS in fp16 as it
runs (runs 2 + 2 + 1, symmetric products split into three half-size GEMMs where the device's
symmetric_split_min says; the table was measured with the split from 512 rows on); and
Gram NS in fp16 with every product a whole GEMM (no split). Rows print as they are measured, so a
time-boxed run keeps what it measured; ``--seconds`` stops starting new rows after that long.

    python scripts/ns_gram_crossover.py --device cuda [--seconds 150]
    python scripts/ns_gram_crossover.py --device cpu --sides 128,256 --batches 1   # smoke test
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gpu import timed  # noqa: E402

from titan_muon.algorithm import newton_schulz  # noqa: E402
from titan_muon.algorithm.newton_schulz import orthogonalize  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--sides", default="256,512,768,1024,1536,2048,3072,4096,6144,8192")
    parser.add_argument("--aspects", default="1.5,2.5,3.5,5")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--seconds", type=float, default=150.0)
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"{name}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}; 5 Polar Express steps, wide matrices, median ms\n")
    print("| m × n | batch | bf16 standard | fp16 gram | fp16 gram, no split | gram / standard | no split / standard |")
    print("|---|---|---|---|---|---|---|", flush=True)
    rows, began = [], time.time()
    for batch in (int(b) for b in args.batches.split(",")):
        for m in (int(s) for s in args.sides.split(",")):
            for aspect in (float(a) for a in args.aspects.split(",")):
                if time.time() - began > args.seconds:
                    print(f"(stopped after {args.seconds:.0f} s)")
                    return _write(args.json, rows)
                n = int(round(m * aspect / 64)) * 64
                x = torch.randn(batch, m, n, device=device) if batch > 1 else torch.randn(m, n, device=device)
                run = lambda dtype, algorithm, x=x: orthogonalize(x, 5, "polar_express", dtype, algorithm=algorithm)
                standard = timed(lambda: run(torch.bfloat16, "standard"), device, repeats=5, warmup=2)
                gram = timed(lambda: run(torch.float16, "gram"), device, repeats=5, warmup=2)
                with mock.patch.object(newton_schulz, "symmetric_split_min", lambda device_type: 1 << 30):
                    whole = timed(lambda: run(torch.float16, "gram"), device, repeats=5, warmup=2)
                rows.append(dict(m=m, n=n, batch=batch, standard_ms=standard, gram_ms=gram, gram_no_split_ms=whole))
                print(f"| {m} × {n} | {batch} | {standard:.3f} | {gram:.3f} | {whole:.3f} | {gram / standard:.2f} | {whole / standard:.2f} |", flush=True)
                del x
    _write(args.json, rows)


def _write(path: str | None, rows: list[dict]) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
