"""DeMo's low-rank compressor (issue 27): one step of warm-started subspace iteration per step.

A PowerSGD/Dion-style alternative to the chunked DCT top-k of dct.py, on the owner of every Muon
matrix (m×n) in each replica r, the replicas' owners of one matrix talking over the replicate
group. k = min(demo_rank, m, n); P (m×k) is the warm-started left factor, the same bits in every
replica (state key ``LEFT_FACTOR_KEY``, laid out like the momentum's rows):

    A_r = β·M_r + g_r                        dct.accumulate_momentum_
    Q_r = A_rᵀ P                 (n×k)       right_projection      (P all zero: starting_factor)
    Q̄ = mean_r Q_r                           all-reduce over the replicas (integration)
    Q̂ = orthonormal basis of Q̄ (QR, fp32)    orthonormal_basis     identical input ⇒ identical bits
    P_r = A_r Q̂                  (m×k)       left_projection
    P̄ = mean_r P_r                           all-reduce over the replicas (integration)
    q = P̄ Q̂ᵀ = Ā·Q̂Q̂ᵀ                        decode: the replicas' average projected on span(Q̂)
    M_r ← A_r − α·q                          dct.subtract_sent_ (error feedback, see below)
    P ← P̄                                    the next step's warm start

This is PowerSGD (Vogels et al., 2019) applied to Aᵀ: the factor kept between steps is the one
with the matrix's rows, so it is stored like the momentum (the parameter's rows: resharded by
DCP along dim 0 and moved by the owners' return trip), and the orthonormalized one is recomputed
every step.

**Error feedback.** Every shared quantity (Q̄, Q̂, P̄, q) depends on the replicas' momenta only
through their average Ā: the step is linear in them except the QR, which sees Q̄ = ĀᵀP. So
subtracting the decoded average q (PowerSGD's rule, used here) and subtracting each replica's own
share P_r·Q̂ᵀ = A_r·Q̂Q̂ᵀ leave the same average Σ_r M_r / R, hence the same q, updates and
parameters in exact arithmetic; they differ only in how the disagreement (A_r − Ā)·Q̂Q̂ᵀ, which
sums to zero over the replicas, is split between the buffers. q is computed anyway, the own
share would be one more m×n×k product per replica (tests/test_demo_low_rank.py checks that both
rules give the same parameters).

Every function works on a batch (b, m, n) of equal-shape matrices at once (no loop per matrix),
on the input's device, with no host reads. A matrix with k = min(m, n) is sent exactly (Q̂ spans
all of its rows' space), but then (m + n)·k ≥ m·n: more bytes than the dense matrix.
"""

from __future__ import annotations

import torch
from torch import Tensor

# PowerSGD's experiments needed rank 1–4 (rank 2 matched SGD on CIFAR-10 ResNet-18, rank 4 on a
# WikiText-2 LSTM); at 4 a 4096×4096 matrix sends (m + n)·4·4 = 131,072 bytes per step, about the
# DCT default's payload (196,608), so the two compressors start from comparable traffic.
DEFAULT_RANK = 4
COMPRESSORS = ("dct", "low_rank")
DEFAULT_COMPRESSOR = "dct"
LEFT_FACTOR_KEY = "demo_left_factor"
STARTING_SEED = 27  # the seed of the fixed starting factor (the number)


def validate_rank(rank) -> None:
    """ValueError naming ``demo_rank`` unless it is an integer >= 1."""
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"demo_rank must be an integer >= 1, got {rank!r}")


def effective_rank(rows: int, cols: int, rank: int) -> int:
    """k = min(rank, rows, cols): a k×n basis with k > min(m, n) cannot be orthonormal."""
    return min(rank, rows, cols)


_STARTS: dict[tuple[int, int, torch.device], Tensor] = {}


def starting_factor(rows: int, k: int, device: torch.device | str = "cpu") -> Tensor:
    """The fixed P used when a matrix's warm start is all zero (a fresh state, or a momentum
    that was exactly zero): standard normal (rows, k) from a CPU generator seeded with
    ``STARTING_SEED`` (drawn row-major), fp32. The same for every matrix of that shape, in every
    replica and on every layout; it only has to be generic (not orthogonal to the momentum's
    row space, which a Gaussian matrix is with probability one). Cached per device."""
    key = (rows, k, torch.device(device))
    start = _STARTS.get(key)
    if start is None:
        generator = torch.Generator(device="cpu").manual_seed(STARTING_SEED)
        start = _STARTS[key] = torch.randn(rows, k, generator=generator, dtype=torch.float32).to(device)
    return start


def warm_start(factors: Tensor) -> Tensor:
    """(b, m, k) left factors with every all-zero one replaced by :func:`starting_factor` (in the
    factors' dtype; a device-side choice per matrix, no host read)."""
    _check_batch(factors, "left factors")
    zero = (factors == 0).all(dim=-1).all(dim=-1)[:, None, None]
    start = starting_factor(factors.shape[1], factors.shape[2], factors.device).to(factors.dtype)
    return torch.where(zero, start, factors)


def right_projection(accumulated: Tensor, factors: Tensor) -> Tensor:
    """Q_r = A_rᵀ P for a batch: (b, m, n), (b, m, k) -> (b, n, k)."""
    _check_batch(accumulated, "momenta")
    return accumulated.transpose(-2, -1) @ factors


def orthonormal_basis(right: Tensor) -> Tensor:
    """Q̂ (b, n, k), orthonormal columns spanning Q̄'s (Householder QR, fp32; a rank-deficient Q̄
    still gets k orthonormal columns). Deterministic: identical input gives identical bits (the
    same LAPACK/cuSOLVER kernel on every replica), so every replica holds the same Q̂."""
    _check_batch(right, "right factors")
    return torch.linalg.qr(right, mode="reduced").Q


def left_projection(accumulated: Tensor, basis: Tensor) -> Tensor:
    """P_r = A_r Q̂: (b, m, n), (b, n, k) -> (b, m, k)."""
    return accumulated @ basis


def decode(left: Tensor, basis: Tensor) -> Tensor:
    """q = P̄ Q̂ᵀ: (b, m, k), (b, n, k) -> (b, m, n)."""
    return left @ basis.transpose(-2, -1)


def payload_elements(rows: int, cols: int, rank: int) -> int:
    """Elements one replica contributes per step for a (rows, cols) matrix: Q_r (cols×k) and P_r (rows×k)."""
    return (rows + cols) * effective_rank(rows, cols, rank)


def payload_bytes(rows: int, cols: int, rank: int) -> int:
    """Bytes of the two all-reduced fp32 factors of one matrix per step (before the ring's 2(R − 1)/R)."""
    return 4 * payload_elements(rows, cols, rank)


def _check_batch(x: Tensor, what: str) -> None:
    if x.ndim != 3 or not x.is_floating_point():
        raise ValueError(f"DeMo low-rank expects a batch of floating-point {what} (b, rows, cols), got shape {tuple(x.shape)} {x.dtype}")
