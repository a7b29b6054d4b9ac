"""Muon's math on one page: what every path of :class:`titan_muon.Muon` computes.

For a hidden weight matrix W (rows × cols) with gradient G and momentum buffer B, one step is

    B ← lerp(B, G, 1 − μ)                         momentum, an average of the gradients
    X ← lerp(G, B, μ)   (Nesterov; else X ← B)    the input Newton–Schulz orthogonalizes
    O ← NS(X)                                     ≈ U Vᵀ of X = U S Vᵀ: every singular value → ~1
    W ← (1 − lr·λ)·W − lr·s(rows, cols)·O         decoupled weight decay λ, shape scale s

where NS is ``steps`` iterations of the odd quintic X ← a·X + (b·A + c·A²)·X with A = X Xᵀ on the
short side, started from X / ‖X‖_F (× 1.01 for Polar Express's coefficients). A 3-D parameter is a
stack of matrices (MoE experts), each its own matrix. With Muon Split (``row_blocks``) each block of
rows (an attention head) is orthogonalized on its own and scaled by its own shape. Parameters in
``use_muon=False`` groups get AdamW.

The optimizer computes exactly this, only faster and on shards: the momentum and Nesterov input in
one pass written into the send buffer, NS batched by shape on one owner rank per matrix (Gram NS
where it is faster, in bf16/fp16 on GPUs), the update and decay in one pass at the commit. The
functions below are the specification those paths are tested against (tests/test_muon_math.py),
in fp32 and written for reading, not speed. tests/reference.py is a second, independent reference.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from titan_muon.algorithm.newton_schulz import POLAR_EXPRESS_SAFETY, coefficient_schedule

ADJUST_LR_FNS = ("original", "match_rms_adamw", "spectral_unclamped")


def nesterov_input(grad: Tensor, momentum_buffer: Tensor, momentum: float, nesterov: bool = True) -> Tensor:
    """Update `momentum_buffer` in place (B ← lerp(B, G, 1 − μ)) and return what NS orthogonalizes."""
    momentum_buffer.lerp_(grad.float(), 1 - momentum)
    return grad.float().lerp(momentum_buffer, momentum) if nesterov else momentum_buffer.clone()


def newton_schulz(x: Tensor, steps: int = 5, coefficients: str | tuple[float, float, float] = "keller", eps: float = 1e-7) -> Tensor:
    """≈ U Vᵀ of one matrix x = U S Vᵀ, in fp32."""
    tall = x.size(0) > x.size(1)
    x = x.float().mT if tall else x.float()
    safety = POLAR_EXPRESS_SAFETY if coefficients == "polar_express" else 1.0
    x = x / (x.norm() * safety).clamp(min=eps)
    for a, b, c in coefficient_schedule(coefficients, steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.mT if tall else x


def lr_scale(rows: int, cols: int, adjust_lr_fn: str | None = None) -> float:
    """The shape scale s on the learning rate of an orthogonalized (rows, cols) update.

    "original" (None, Keller Jordan): √max(1, rows/cols). "match_rms_adamw" (Moonlight):
    0.2·√max(rows, cols), an update with a typical AdamW update's RMS, so AdamW's lr and decay carry
    over. "spectral_unclamped" (torchtitan 0.3.0's DistMuon): √(rows/cols), below 1 for wide matrices.
    The first two are ``torch.optim.Muon``'s names and meanings.
    """
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return math.sqrt(max(1.0, rows / cols))
    if adjust_lr_fn == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    if adjust_lr_fn == "spectral_unclamped":
        return math.sqrt(rows / cols)
    raise ValueError(f"unknown adjust_lr_fn {adjust_lr_fn!r}; expected None or one of {ADJUST_LR_FNS}")


def orthogonalized_update(x: Tensor, steps: int = 5, coefficients="keller", eps: float = 1e-7,
                          adjust_lr_fn: str | None = None, row_block: int | None = None) -> Tensor:  # fmt: skip
    """s·O for a matrix or a stack of them (one per leading index), each block of `row_block` rows
    (all rows by default) orthogonalized and scaled on its own."""
    if x.ndim == 3:
        return torch.stack([orthogonalized_update(m, steps, coefficients, eps, adjust_lr_fn, row_block) for m in x])
    blocks = x.split(row_block or x.size(0))
    return torch.cat([lr_scale(*b.shape, adjust_lr_fn) * newton_schulz(b, steps, coefficients, eps) for b in blocks])


def apply_update(param: Tensor, update: Tensor, lr: float, weight_decay: float) -> None:
    """W ← (1 − lr·λ)·W − lr·update, in place (`update` already carries the shape scale)."""
    param.mul_(1 - lr * weight_decay).sub_(lr * update)


@torch.no_grad()
def muon_step(param: Tensor, grad: Tensor, momentum_buffer: Tensor, *, lr: float, weight_decay: float = 0.1,
              momentum: float = 0.95, nesterov: bool = True, ns_steps: int = 5, ns_coefficients="keller",
              eps: float = 1e-7, adjust_lr_fn: str | None = None, row_block: int | None = None) -> None:  # fmt: skip
    """One Muon step of one parameter (a matrix or a stack of them), in place, with the group's settings."""
    x = nesterov_input(grad, momentum_buffer, momentum, nesterov)
    apply_update(param, orthogonalized_update(x, ns_steps, ns_coefficients, eps, adjust_lr_fn, row_block), lr, weight_decay)
