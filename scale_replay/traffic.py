"""Elements each rank sends per Muon step, against its Muon shard, as the plan lays them out:
the figures of docs/exchange.md ("Bytes each rank sends") and docs/reliability.md ("Traffic bound").

    python scripts/measure_traffic.py

A rank sends its pieces of the matrices owned elsewhere and returns the other ranks' pieces of
the matrices it owns (``plan.elements_sent``: outbound and return trips, itself excluded), so it
sends at most its shard plus the matrices it owns. The plan balances Newton–Schulz work per
owner, not bytes, so the ratio to the shard has no fixed bound; this prints the busiest rank's.
Pure plan arithmetic on the CPU (no process group): FSDP, ``Shard(0)`` over W ranks.
"""

from __future__ import annotations

import itertools

import torch
from torch.distributed.tensor import Shard


from scale_replay import model_presets as presets

from titan_muon.algorithm.newton_schulz import newton_schulz_flops
from titan_muon.base.layout import RankGrid, box_numel, sharding_of
from titan_muon.exchange.plan import Unit, build_plan, elements_sent, rank_tables
from titan_muon.settings import DEFAULT_EXCHANGE_MEMORY_MB, owner_bytes_per_element

# The optimizer's defaults: DEFAULT_EXCHANGE_MEMORY_MB per rank for 2 rounds in flight; bf16 wire and NS (CUDA's
# "auto") for the model presets, fp32 (CPU's) for the small test shapes.
DEFAULT_ROUND_BYTES = DEFAULT_EXCHANGE_MEMORY_MB * 2**20 / 2

# Small uneven FSDP shapes: the suite's (tests/common.py SHAPES), and the worst a seeded random
# search of 3000 sets of 2-6 matrices of 1-80 rows and columns found at W = 2 and W = 3.
SMALL_CASES = {
    "suite's shapes, W = 2": ([(30, 64), (63, 64), (3, 256), (64, 30), (48, 48)], 2),
    "suite's shapes, W = 3": ([(30, 64), (63, 64), (3, 256), (64, 30), (48, 48)], 3),
    "random search, W = 2": ([(1, 72), (4, 31)], 2),
    "random search, W = 3": ([(7, 48), (7, 43), (13, 27)], 3),
}
MODEL_CASES = {"Llama-3 8B, W = 8": ("Llama-3 8B", 8), "Llama-3 70B, W = 64": ("Llama-3 70B", 64),
               "Llama-3 8B, W = 64": ("Llama-3 8B", 64)}  # fmt: skip


def per_rank(units: list[Unit], shardings: list, world: int, cost, owner_bytes: float) -> list[tuple[int, int, int]]:
    """(elements sent, Muon shard, elements of the units it owns) of every rank."""
    plan = build_plan(units, shardings, world, DEFAULT_ROUND_BYTES, cost=cost, owner_bytes_per_element=owner_bytes)
    rows = []
    for rank in range(world):
        tables = rank_tables(plan, shardings, rank)
        owned = sum(plan.units[u].rows * plan.units[u].cols for t in tables for u in t.owned)
        rows.append((elements_sent(tables, rank), sum(box_numel(s.box(rank)) for s in shardings), owned))
    return rows


def small_case(shapes: list[tuple[int, int]], world: int) -> list[tuple[int, int, int]]:
    grid = RankGrid(list(itertools.product(range(world))))
    shardings = [sharding_of(shape, [Shard(0)], (world,), grid) for shape in shapes]
    units = [Unit(p, 0, 0, rows, cols) for p, (rows, cols) in enumerate(shapes)]
    fp32 = owner_bytes_per_element(torch.float32, torch.float32)
    return per_rank(units, shardings, world, lambda u: newton_schulz_flops(u.rows, u.cols, presets.NS_STEPS), fp32)


def model_case(name: str, world: int) -> list[tuple[int, int, int]]:
    model = presets.PRESETS[name]
    bf16 = owner_bytes_per_element(torch.bfloat16, torch.bfloat16)
    return per_rank(presets.units_of(model), presets.Layout().shardings(model, world), world, presets.ns_flops, bf16)


def busiest_ratio(rows: list[tuple[int, int, int]]) -> float:
    """The largest elements sent / Muon shard over the ranks that hold a shard."""
    return max(sent / shard for sent, shard, _ in rows if shard)


def all_cases() -> dict[str, list[tuple[int, int, int]]]:
    cases = {label: small_case(*case) for label, case in SMALL_CASES.items()}
    cases.update({label: model_case(*case) for label, case in MODEL_CASES.items()})
    return cases


def main() -> None:
    print("| layout | busiest rank: sent / its Muon shard |\n|---|---|")
    for label, rows in all_cases().items():
        print(f"| {label} | {busiest_ratio(rows):.2f}× |")
