"""The figures ``Muon.last_step_metrics`` reports for a step, gathered without host reads."""

from __future__ import annotations

import math

from torch import Tensor

from titan_muon.base.dtensor import local_shard
from titan_muon.exchange.overlap import metrics as overlap_metrics
from titan_muon.timing import StepTimer


def step_metrics(work, timer: StepTimer, engines, skipped_steps: int, early: list, momentum: list[dict], storage,
                 replicas=None) -> dict[str, float | Tensor]:  # fmt: skip
    """This rank's figures: times (device events on CUDA, read lazily), Newton–Schulz FLOPs,
    bytes on the wire in both directions (during backward and in ``step()``), peak transient
    bytes, rounds, skipped steps, the update RMS (a device scalar), momentum bytes per element
    (`momentum`: every state dict holding Muon momentum), overlap's and DeMo's figures. Resets
    the lanes' byte counters, so the next step's backward sends are counted from here."""
    metrics: dict[str, float | Tensor] = {
        "muon/step_time_ms": timer.elapsed_ms("step"),
        "muon/ns_time_ms": timer.elapsed_ms("ns"),
        "muon/ns_flops": float(work.ns_flops),
        **wire_bytes(engines),
        "muon/bytes_sent_to_owners": float(sum(engine.bytes_to_owners for engine in engines)),
        "muon/skipped_steps": float(skipped_steps),
        "muon/peak_transient_bytes": float(work.memory.peak),
        "muon/kept_reservation_bytes": float(work.memory.kept),
        "muon/rounds": float(sum(len(engine.tables) for engine in engines)),
        **momentum_metrics(momentum, storage.tensor_keys[0]),
        **overlap_metrics(early),
        **(replicas.metrics() if replicas is not None else {}),
    }
    if work.update_numel and work.update_sq is not None:  # measured (Muon.measure_update_rms)
        metrics["muon/update_rms"] = (work.update_sq / work.update_numel).sqrt()
        metrics["muon/update_elements"] = float(work.update_numel)
    return metrics


def wire_bytes(engines) -> dict[str, float]:
    """``muon/bytes_sent`` and ``muon/bytes_received`` of the exchange lanes since the last call
    (this step's, backward included), and the counters reset for the next step."""
    lanes = [lane for engine in engines for lane in (engine.outbound, engine.back)]
    metrics = {
        "muon/bytes_sent": float(sum(lane.bytes_sent for lane in lanes)),
        "muon/bytes_received": float(sum(lane.bytes_received for lane in lanes)),
    }
    for lane in lanes:
        lane.bytes_sent = lane.bytes_received = 0
    return metrics


def state_bytes(states) -> int:
    """Bytes of the tensors (not the 0-dim counters) in `states`, dicts of state tensors; a
    DTensor counts its local block."""
    tensors = [v for state in states for v in state.values() if isinstance(v, Tensor) and v.ndim > 0]
    return sum(local_shard(t).numel() * local_shard(t).element_size() for t in tensors)


def momentum_bytes_per_element(states, primary_key: str) -> float:
    """Bytes of Muon momentum this rank holds per momentum element (`primary_key`'s elements):
    4 for fp32, 2 for bf16, ~1.004 for fp8 (codes plus one exponent per 256 columns)."""
    return momentum_metrics(states, primary_key)["muon/momentum_bytes_per_element"]


def momentum_metrics(states, primary_key: str) -> dict[str, float]:
    """``muon/momentum_bytes_per_element`` (:func:`momentum_bytes_per_element`) and the element
    count it is per, ``muon/momentum_elements`` (its weight when model parts are merged)."""
    held = [state for state in states if primary_key in state and state[primary_key].ndim > 0]
    elements = sum(local_shard(state[primary_key]).numel() for state in held)
    return {
        "muon/momentum_bytes_per_element": state_bytes(held) / elements if elements else 0.0,
        "muon/momentum_elements": float(elements),
    }


# How one figure of several optimizers that step one after another (one per model part, as
# torchtitan's pipeline schedules with several stages per rank have them) combines into the
# rank's figure: "sum" for amounts (times, FLOPs, bytes, rounds); "max" for a peak (the parts'
# transients are freed between them) and for skipped_steps (the parts skip together: the
# same count in each); ("mean", weight) for a ratio, weighted by the metric counting what it is
# per; ("rms", weight) for a root mean square, whose squares are weighted.
PART_MERGE_RULES: dict[str, str | tuple[str, str]] = {
    "muon/step_time_ms": "sum",
    "muon/ns_time_ms": "sum",
    "muon/ns_flops": "sum",
    "muon/bytes_sent": "sum",
    "muon/bytes_received": "sum",
    "muon/bytes_sent_to_owners": "sum",
    "muon/bytes_sent_in_backward": "sum",
    "muon/rounds": "sum",
    "muon/rounds_sent_in_backward": "sum",
    "muon/update_elements": "sum",
    "muon/momentum_elements": "sum",
    "muon/skipped_steps": "max",
    "muon/peak_transient_bytes": "max",
    "muon/kept_reservation_bytes": "sum",
    "muon/update_rms": ("rms", "muon/update_elements"),
    "muon/momentum_bytes_per_element": ("mean", "muon/momentum_elements"),
    "demo/bytes_sent": "sum",
    "demo/bytes_dense": "sum",
    "demo/adamw_bytes_sent": "sum",
    "demo/total_bytes_sent": "sum",
    "demo/total_bytes_dense": "sum",
}


def merge_part_metrics(per_part: list[dict[str, float]]) -> dict[str, float]:
    """One rank's figures from its model parts' (:data:`PART_MERGE_RULES`); a part without a
    figure (no update this step, no backward sends) adds nothing to it."""
    merged: dict[str, float] = {}
    for key in dict.fromkeys(k for metrics in per_part for k in metrics):
        if key not in PART_MERGE_RULES:
            raise KeyError(f"titan_muon: no rule merges the metric {key!r} over model parts; add it to metrics.PART_MERGE_RULES")
        rule = PART_MERGE_RULES[key]
        present = [metrics for metrics in per_part if key in metrics]
        if rule == "sum":
            merged[key] = sum(metrics[key] for metrics in present)
        elif rule == "max":
            merged[key] = max(metrics[key] for metrics in present)
        else:
            kind, weight_key = rule
            weights = [metrics.get(weight_key, 0.0) for metrics in present]
            total = sum(weights)
            if kind == "rms":
                merged[key] = math.sqrt(sum(w * m[key] ** 2 for w, m in zip(weights, present)) / total) if total else 0.0
            else:
                merged[key] = sum(w * m[key] for w, m in zip(weights, present)) / total if total else 0.0
    return merged
