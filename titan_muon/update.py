"""Muon's element-wise update rules: pure tensor math on whatever rows a rank holds.

Only Newton–Schulz needs whole matrices; momentum, Nesterov, weight decay and the step
itself are element-wise, so they run on local FSDP shards with no communication.
"""

from __future__ import annotations

import math

from torch import Tensor
from torch.distributed.tensor import DTensor

ADJUST_LR_FNS = ("original", "match_rms_adamw")


def local_shard(t: Tensor) -> Tensor:
    """The rows this rank holds: a DTensor's local tensor (a view: in-place updates reach it), else t."""
    return t.to_local() if isinstance(t, DTensor) else t


def update_scale(adjust_lr_fn: str | None, rows: int, cols: int) -> float:
    """Multiplier on the learning rate for an orthogonalized (rows, cols) update.

    "original" (Keller Jordan, the default): sqrt(max(1, rows / cols)).
    "match_rms_adamw" (Moonlight): 0.2 * sqrt(max(rows, cols)), which gives the update the RMS
    of a typical AdamW update so AdamW's learning rate and weight decay carry over.
    Same names and meanings as ``torch.optim.Muon``'s ``adjust_lr_fn``.
    """
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return math.sqrt(max(1.0, rows / cols))
    if adjust_lr_fn == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    raise ValueError(f"unknown adjust_lr_fn {adjust_lr_fn!r}; expected None or one of {ADJUST_LR_FNS}")


def momentum_step(grad: Tensor, momentum_buffer: Tensor, momentum: float, nesterov: bool) -> Tensor:
    """Update the buffer in place (M ← μM + (1−μ)g) and return the matrix to orthogonalize."""
    momentum_buffer.lerp_(grad, 1 - momentum)
    return grad.lerp(momentum_buffer, momentum) if nesterov else momentum_buffer.clone()


def apply_update(param: Tensor, scaled_update: Tensor, lr: float, weight_decay: float) -> None:
    """Decoupled weight decay, then the step: W ← (1 − lr·wd)·W − lr·scaled_update."""
    param.mul_(1 - lr * weight_decay)
    param.add_(scaled_update, alpha=-lr)
