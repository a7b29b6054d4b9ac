"""Muon's element-wise rules: pure tensor math on whatever block of a matrix a rank holds.

Only Newton–Schulz needs whole matrices; momentum, Nesterov, weight decay and the step
itself are element-wise, so they run on local blocks with no communication.

A step computes the matrix to orthogonalize from the gradient and the *old* momentum
(:func:`nesterov_input`) and writes the new momentum only at the commit, once every rank
has succeeded (:func:`update_momentum_`): both apply the same ``lerp``, so the momentum the
step used is bit for bit the momentum it stores.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

ADJUST_LR_FNS = ("original", "match_rms_adamw", "spectral_unclamped")


def local_shard(t: Tensor) -> Tensor:
    """The block this rank holds: a DTensor's local tensor (a view: in-place updates reach it), else t."""
    return t.to_local() if isinstance(t, DTensor) else t


def update_scale(adjust_lr_fn: str | None, rows: int, cols: int) -> float:
    """Multiplier on the learning rate for an orthogonalized (rows, cols) update.

    "original" (Keller Jordan, the default): sqrt(max(1, rows / cols)).
    "match_rms_adamw" (Moonlight): 0.2 * sqrt(max(rows, cols)), which gives the update the RMS
    of a typical AdamW update so AdamW's learning rate and weight decay carry over.
    "spectral_unclamped": sqrt(rows / cols) = sqrt(fan_out / fan_in), below 1 for wide matrices
    (torchtitan 0.3.0 DistMuon's ``_adjust_muon_learning_rate``, flex_shard/dist_muon.py).
    The first two are ``torch.optim.Muon``'s names and meanings; the third is DistMuon's.
    """
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return math.sqrt(max(1.0, rows / cols))
    if adjust_lr_fn == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    if adjust_lr_fn == "spectral_unclamped":
        return math.sqrt(rows / cols)
    raise ValueError(f"unknown adjust_lr_fn {adjust_lr_fn!r}; expected None or one of {ADJUST_LR_FNS}")


def nesterov_input(grad: Tensor, momentum: Tensor, beta: float, nesterov: bool, out: Tensor | None = None) -> Tensor:
    """The matrix to orthogonalize, from the gradient and the momentum M before this step.

    With M' = βM + (1−β)g: Nesterov's g + β(M' − g), else M'. The same two lerps as
    ``torch.optim.Muon`` (so bf16 Newton–Schulz sees bit-identical inputs), out of place:
    `momentum` is left unchanged (see :func:`update_momentum_`); `out` may receive the result.
    """
    new = torch.lerp(momentum, grad, 1 - beta, out=None if nesterov else out)
    return torch.lerp(grad, new, beta, out=out) if nesterov else new


def nesterov_input_and_momentum(grad: Tensor, momentum: Tensor, beta: float, nesterov: bool, out: Tensor) -> Tensor:
    """:func:`nesterov_input` written into `out`, also returning the new momentum M' (a new
    tensor, bit for bit what :func:`update_momentum_` would make of `momentum`)."""
    new = torch.lerp(momentum, grad, 1 - beta)
    if nesterov:
        torch.lerp(grad, new, beta, out=out)
    else:
        out.copy_(new)
    return new


def update_momentum_(momentum: Tensor, grad: Tensor, beta: float) -> Tensor:
    """In place: M ← βM + (1−β)g, the same operation :func:`nesterov_input` applied."""
    return momentum.lerp_(grad, 1 - beta)


def apply_updates_(params: Sequence[Tensor], updates: Sequence[Tensor], lr: float, weight_decay: float) -> None:
    """Decoupled weight decay, then the step, for many blocks at once: W ← (1 − lr·wd)·W − lr·U.

    In place, allocating nothing (the commit must not fail half-way). The decay factor is a
    0-dim fp32 tensor on the parameters' device: a Python float would be rounded to the
    parameters' dtype by the foreach kernels (bf16: 1 − 0.002 becomes 0.99609375, more than
    twice the decay), while a tensor factor is applied in fp32 like ``param.mul_(float)``.
    """
    if not params:
        return
    if lr * weight_decay != 0:
        factor = torch.full((), 1 - lr * weight_decay, dtype=torch.float32, device=params[0].device)
        torch._foreach_mul_(list(params), factor)
    torch._foreach_add_(list(params), list(updates), alpha=-lr)  # mixed dtypes: no converted copy of the updates
