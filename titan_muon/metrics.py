"""The figures ``Muon.last_step_metrics`` reports for a step, gathered without host reads."""

from __future__ import annotations

import torch
from torch import Tensor

from titan_muon.overlap import metrics as overlap_metrics
from titan_muon.timing import StepTimer
from titan_muon.update import local_shard


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
        "muon/rounds": float(sum(len(engine.tables) for engine in engines)),
        "muon/momentum_bytes_per_element": momentum_bytes_per_element(momentum, storage.tensor_keys[0]),
        **overlap_metrics(early),
        **(replicas.metrics() if replicas is not None else {}),
    }
    if work.update_sq:
        metrics["muon/update_rms"] = (torch.stack(work.update_sq).sum() / work.update_numel).sqrt()
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
    held = [state for state in states if primary_key in state and state[primary_key].ndim > 0]
    elements = sum(local_shard(state[primary_key]).numel() for state in held)
    return state_bytes(held) / elements if elements else 0.0
