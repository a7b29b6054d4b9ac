"""Bytes the optimizer step moves per Muon element, counted from the traced step (no device).

The real ``Muon.step()`` of every rank runs on ``meta`` over a fake process group
(scale_replay/step_trace.py); every kernel it launches is recorded with the bytes it reads and
writes, by the phase it runs in. This prints, per side of the step (step_trace.STEP_SIDES:
the non-finite check reads the gradients, the shard side packs, the owners assemble, orthogonalize, scale and disassemble, the commit
writes momentum and weights), the bytes per Muon element the ranks hold, with the element-wise
passes eager (several torch ops each) and compiled (one kernel each, as on CUDA by default),
next to fused AdamW's 28 (fp32 weight, gradient and two moments read, three written back).
Newton–Schulz's matrix products are not counted: they are the work itself.

    python scripts/step_bytes.py                          # Llama-3 8B, W = 8, Muon's CUDA defaults
    python scripts/step_bytes.py --model "Llama-3 70B" --world 64 --ranks 8
"""

from __future__ import annotations

import argparse

from scale_replay.model_presets import PRESETS  # noqa: E402
from scale_replay.simulate import CUDA_DEFAULTS, stage_params  # noqa: E402
from scale_replay.step_trace import bytes_per_muon_element, trace_rank  # noqa: E402


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="Llama-3 8B", choices=sorted(PRESETS))
    parser.add_argument("--world", type=int, default=8)
    parser.add_argument("--ranks", type=int, default=None, help="trace the first N ranks (default: all)")
    parser.add_argument("--layers", type=int, default=2, help="transformer layers traced (bytes per element do not depend on it)")
    args = parser.parse_args(argv)
    muon, adamw = stage_params(PRESETS[args.model])
    muon = [(name, shape) for name, shape in muon if int(name.split(".")[1]) < args.layers]
    print(f"{args.model}, {args.layers} layers, W = {args.world}, Muon's defaults as on CUDA {CUDA_DEFAULTS or ''}")
    print("| element-wise passes | check | shard | owner | commit | total B per Muon element | inside the NS phase, beside its GEMMs |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for compiled in (False, True):
        settings = {**CUDA_DEFAULTS, "compile_elementwise": compiled}
        traces = [trace_rank(rank, args.world, muon, adamw, **settings) for rank in range(args.ranks or args.world)]
        sides = bytes_per_muon_element(traces)
        label = "compiled (one kernel each)" if compiled else "eager (torch ops)"
        print(f"| {label} | {sides['check']:.1f} | {sides['shard']:.1f} | {sides['owner']:.1f} | {sides['commit']:.1f} | {sides['total']:.1f} | "
              f"{sides['newton_schulz']:.1f} |")
    print("| fused AdamW, for comparison | | | | | 28 | |")


if __name__ == "__main__":
    main()
