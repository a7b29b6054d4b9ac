"""The step's first agreement: what to do about missing and non-finite gradients.

One all-reduce carries, per parameter, whether its gradient is missing and whether it is
non-finite on this rank, and with overlap what the gradients sent during backward were
(overlap.py); the host reads the result once. Every rank reaches the same verdict and raises
the same error, before anything changes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed
from torch import Tensor

from titan_muon.transport import Transport
from titan_muon.update import local_shard


@dataclass
class Verdict:
    skip_step: bool = False  # non-finite gradients with nonfinite_grads="skip"
    skipped: set[int] = field(default_factory=set)  # ids of parameters with no gradient on any rank
    early: list = field(default_factory=list)  # per rank set: overlap.EarlySends or None


def agree_on_gradients(params: Sequence[Tensor], name_of: Callable[[int], str], transport: Transport, overlaps: Sequence,
                       nonfinite_policy: str, pipeline: Transport | None = None) -> Verdict:  # fmt: skip
    """`params`: every parameter of the optimizer, in a fixed order; `overlaps`: per rank set its
    BackwardOverlap or None; `pipeline`: the other pipeline stages' optimizers, which must raise
    or skip with this one (a MAX all-reduce of "any non-finite gradient", on the device)."""
    grads = [None if p.grad is None else local_shard(p.grad) for p in params]
    checked = [g for g in grads if g is not None and g.numel() > 0]
    # The L2 norm is NaN/Inf iff an entry is, or iff it overflows (> 1.8e19 in fp32), where the
    # grad-norm clipping that precedes the step would be Inf as well. One fused kernel on GPUs;
    # on CPU 17x faster than the max-abs norm (measured: 1.1 vs 17.8 ms on 5 M elements).
    norms = torch._foreach_norm(checked, 2) if checked else []
    if len(checked) == len(grads):  # the usual case: one stack, no per-parameter ops
        missing = torch.zeros(len(grads), dtype=torch.float64, device=transport.device)
        per_param = torch.stack(norms) if norms else missing
    else:
        zero = torch.zeros((), dtype=torch.float64, device=transport.device)
        one = torch.ones((), dtype=torch.float64, device=transport.device)
        found = iter(norms)
        missing = torch.stack([zero if g is not None else one for g in grads])
        per_param = torch.stack([next(found) if g is not None and g.numel() > 0 else zero for g in grads])
    parts = [missing, per_param.isfinite().logical_not().double()]
    active = [o for o in overlaps if o is not None]
    sizes = [o.sums_size for o in active]
    parts += [o.gradient_sums() for o in active]
    status = transport.all_reduce(torch.cat(parts))
    n = len(params)
    tail, compared = status[2 * n :], []
    for o, size in zip(active, sizes):  # derived on the device, so the host still reads once
        compared.append(o.compare(tail[:size]))
        tail = tail[size:]
    elsewhere = []
    if pipeline is not None:
        any_here = status[n : 2 * n].amax() if n else torch.zeros((), dtype=torch.float64, device=transport.device)
        elsewhere = [pipeline.all_reduce(any_here.reshape(1).clone(), torch.distributed.ReduceOp.MAX)]
    host = torch.cat([status[: 2 * n], *compared, *elsewhere]).tolist()
    other_stage = bool(host[-1]) if pipeline is not None else False

    world = transport.world_size
    missing_counts, nonfinite = host[:n], host[n : 2 * n]
    partial = [i for i, c in enumerate(missing_counts) if 0 < c < world]
    bad = [name_of(i) for i, c in enumerate(nonfinite) if c > 0]
    usable = not (partial or bad)  # else every early send is waited for and dropped
    offset, early = 2 * n, []
    for o in overlaps:
        if o is None:
            early.append(None)
            continue
        size = o.decision_size
        early.append(o.decide(host[offset : offset + size], world, usable))
        offset += size
    if partial:
        names = [name_of(i) for i in partial]
        here = "present" if grads[partial[0]] is not None else "missing"
        raise RuntimeError(
            f"titan_muon.Muon: gradients of {names} exist on some ranks but not on others (the first is "
            f"{here} on this rank). Every rank must produce the same set of gradients; nothing was changed."
        )
    if bad or other_stage:
        if nonfinite_policy == "skip":
            return Verdict(skip_step=True)
        where = f"in {bad}" if bad else "in another pipeline stage"
        raise FloatingPointError(
            f"titan_muon.Muon: non-finite (NaN/Inf) gradients {where}; no parameter or state was changed. "
            'Pass nonfinite_grads="skip" to skip such steps instead.'
        )
    skipped = {id(p) for p, c in zip(params, missing_counts) if c == world}
    return Verdict(skipped=skipped, early=early)
