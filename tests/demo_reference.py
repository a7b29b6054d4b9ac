"""Independent one-process references of DeMo-Muon (seed 002) over R simulated replicas: the DCT
compressor (ReferenceDeMoMuon) and the low-rank one (ReferenceLowRankDeMoMuon, issue 27).

Written from the paper's description, not from titan_muon.demo.dct: one chunk at a time in a plain
loop, its own DCT-II matrix from the definition (double loop), selection by Python's sort on
(−|c|, position), kept count per chunk from exact fractions, and each replica's sent part
decoded on its own before the average. The low-rank reference is written from PowerSGD's
description, not from titan_muon.demo.low_rank: one matrix and one replica at a time, each
replica's projections summed in a loop, its own Gram–Schmidt instead of a QR kernel (the same
span for a full-rank Q̄, column signs aside). Only Newton–Schulz and the update scale come from
titan_muon, as the brief asks (they are not what is under test here).
"""

from __future__ import annotations

import math
from fractions import Fraction

import torch

from titan_muon.algorithm.newton_schulz import orthogonalize
from titan_muon.algorithm.update import update_scale


def least_squares_problem(shapes, replicas, dtype, seed=20):
    """Least squares per replica: loss_r(W) = |X_r W − Y_r|² / (2b), each replica its own batch;
    returns the initial matrices and grads(current) -> one gradient dict per replica."""
    g, b = torch.Generator().manual_seed(seed), 24
    params = {f"w{k}": (0.1 * torch.randn(*s, generator=g)).to(dtype) for k, s in enumerate(shapes)}
    data = [
        {n: (torch.randn(b, p.shape[0], generator=g).to(dtype), torch.randn(b, p.shape[1], generator=g).to(dtype)) for n, p in params.items()}
        for _ in range(replicas)
    ]

    def grads(current):
        return [{n: x.T @ (x @ current[n] - y) / b for n, (x, y) in d.items()} for d in data]

    return params, grads


def reference_dct(size: int) -> torch.Tensor:
    """Orthonormal DCT-II, float64: row k is sqrt(2/N)·c_k·cos(π(2i+1)k/(2N)), c_0 = 1/√2."""
    rows = []
    for k in range(size):
        ck = math.sqrt(1.0 / size) if k == 0 else math.sqrt(2.0 / size)
        rows.append([ck * math.cos(math.pi * (2 * i + 1) * k / (2 * size)) for i in range(size)])
    return torch.tensor(rows, dtype=torch.float64)


def chunk_corners(rows: int, cols: int, chunk: int):
    """(r0, c0, h, w) of every chunk, row-major over the chunk grid."""
    for r0 in range(0, rows, chunk):
        for c0 in range(0, cols, chunk):
            yield r0, c0, min(chunk, rows - r0), min(chunk, cols - c0)


def kept_count(h: int, w: int, chunk: int, topk: int) -> int:
    return math.ceil(Fraction(topk * h * w, chunk * chunk))


def chunk_topk(coefficients: torch.Tensor, keep: int) -> list[int]:
    """Positions (row-major) of the `keep` largest magnitudes, ties to the lower position."""
    flat = coefficients.reshape(-1).tolist()
    return sorted(range(len(flat)), key=lambda t: (-abs(flat[t]), t))[:keep]


def reference_send(momentum: torch.Tensor, chunk: int, topk: int) -> tuple[torch.Tensor, list]:
    """What one replica sends for one matrix: the dense decoded kept part (same dtype as
    momentum, the DCT done in that dtype with the basis rounded from float64) and, per chunk,
    the list of (position, value) pairs in selection order."""
    rows, cols = momentum.shape
    sent = torch.zeros_like(momentum)
    pairs = []
    for r0, c0, h, w in chunk_corners(rows, cols, chunk):
        dh, dw = reference_dct(h).to(momentum.dtype), reference_dct(w).to(momentum.dtype)
        block = momentum[r0 : r0 + h, c0 : c0 + w]
        coefficients = dh @ block @ dw.T
        positions = chunk_topk(coefficients, kept_count(h, w, chunk, topk))
        flat = coefficients.reshape(-1)
        kept = torch.zeros_like(flat)
        kept[positions] = flat[positions]
        sent[r0 : r0 + h, c0 : c0 + w] = dh.T @ kept.reshape(h, w) @ dw
        pairs.append([(p, flat[p].item()) for p in positions])
    return sent, pairs


class ReferenceDeMoMuon:
    """R replicas, each with its own momentum per matrix; parameters shared (they stay equal).

    With ``shared_momentum`` (issue 27) one more buffer per matrix, the same for all replicas:
    S = β·S + (1 − β)·q over the average q, and Newton–Schulz gets (1 − β)·q + β·S with
    ``nesterov`` (else S), β being the same ``beta`` as the replicas' own buffers.
    ``shared_momentum=False`` (and nesterov is then ignored) is the original DeMo-Muon: NS gets q.
    """

    def __init__(self, replicas, lr, weight_decay=0.0, beta=0.95, chunk=64, topk=8, alpha=0.2, ns_steps=5, adjust_lr_fn=None,
                 shared_momentum=False, nesterov=False):  # fmt: skip
        self.replicas, self.lr, self.wd, self.beta = replicas, lr, weight_decay, beta
        self.chunk, self.topk, self.alpha, self.ns_steps, self.adjust = chunk, topk, alpha, ns_steps, adjust_lr_fn
        self.shared_momentum, self.nesterov = shared_momentum, nesterov
        self.momenta: list[dict[str, torch.Tensor]] = [{} for _ in range(replicas)]
        self.shared: dict[str, torch.Tensor] = {}
        self.last_q: dict[str, torch.Tensor] = {}
        self.last_input: dict[str, torch.Tensor] = {}

    def step(self, params: dict[str, torch.Tensor], grads: list[dict[str, torch.Tensor]]) -> None:
        assert len(grads) == self.replicas
        for name, p in params.items():
            sent_by_replica = []
            for r in range(self.replicas):
                m = self.momenta[r].setdefault(name, torch.zeros_like(p))
                m.copy_(self.beta * m + grads[r][name])
                sent, _ = reference_send(m, self.chunk, self.topk)
                m.copy_(m - self.alpha * sent)
                sent_by_replica.append(sent)
            q = sum(sent_by_replica) / self.replicas
            self.last_q[name] = q
            ns_input = q
            if self.shared_momentum:
                shared = self.shared.setdefault(name, torch.zeros_like(p))
                shared.copy_(self.beta * shared + (1 - self.beta) * q)
                ns_input = (1 - self.beta) * q + self.beta * shared if self.nesterov else shared.clone()
            self.last_input[name] = ns_input
            u = orthogonalize(ns_input, self.ns_steps, dtype=p.dtype)
            rows, cols = p.shape
            p.copy_((1 - self.lr * self.wd) * p - self.lr * update_scale(self.adjust, rows, cols) * u)


# ---------------------------------------------------------------- the low-rank compressor (issue 27)

# The starting left factor when a warm start is all zero (docs/demo.md "Low-rank compressor"):
# standard normal (rows, k) from a CPU generator seeded with 27, drawn row-major, fp32.
LOW_RANK_SEED = 27


def reference_start(rows: int, k: int) -> torch.Tensor:
    return torch.randn(rows, k, generator=torch.Generator().manual_seed(LOW_RANK_SEED), dtype=torch.float32)


def gram_schmidt(a: torch.Tensor) -> torch.Tensor:
    """Orthonormal columns spanning a full-column-rank `a` (n×k), column by column: classical
    Gram–Schmidt with one full re-orthogonalization pass (CGS2), the diagonal of R positive."""
    columns: list[torch.Tensor] = []
    for j in range(a.shape[1]):
        v = a[:, j].clone()
        for _ in range(2):
            for c in columns:
                v = v - (c @ v) * c
        columns.append(v / v.norm())
    return torch.stack(columns, dim=1)


class ReferenceLowRankDeMoMuon:
    """R replicas with DeMo's low-rank compressor, one matrix and one replica at a time.

    Per matrix (m×n, k = min(rank, m, n)): A_r = β·M_r + g_r; P the warm start (the fixed start
    when all zero); Q̄ = (1/R)·Σ_r A_rᵀP; Q̂ = gram_schmidt(Q̄); P̄ = (1/R)·Σ_r A_r Q̂; q = P̄ Q̂ᵀ;
    error feedback M_r = A_r − α·q (``feedback="average"``, PowerSGD's rule) or M_r = A_r −
    α·(A_r Q̂)Q̂ᵀ (``"own"``: each replica's own share); P ← P̄. Then the shared momentum and Muon
    as in ReferenceDeMoMuon. ``factors`` hold P with ``rank`` columns (zeros beyond k).
    """

    def __init__(self, replicas, lr, weight_decay=0.0, beta=0.95, rank=4, alpha=1.0, ns_steps=5, adjust_lr_fn=None,
                 shared_momentum=True, nesterov=True, feedback="average"):  # fmt: skip
        assert feedback in ("average", "own")
        self.replicas, self.lr, self.wd, self.beta, self.rank, self.alpha = replicas, lr, weight_decay, beta, rank, alpha
        self.ns_steps, self.adjust, self.shared_momentum, self.nesterov, self.feedback = ns_steps, adjust_lr_fn, shared_momentum, nesterov, feedback
        self.momenta: list[dict[str, torch.Tensor]] = [{} for _ in range(replicas)]
        self.shared: dict[str, torch.Tensor] = {}
        self.factors: dict[str, torch.Tensor] = {}
        self.last_q: dict[str, torch.Tensor] = {}
        self.last_basis: dict[str, torch.Tensor] = {}
        self.last_right: dict[str, torch.Tensor] = {}
        self.last_input: dict[str, torch.Tensor] = {}

    def step(self, params: dict[str, torch.Tensor], grads: list[dict[str, torch.Tensor]]) -> None:
        assert len(grads) == self.replicas
        for name, p in params.items():
            rows, cols = p.shape
            k = min(self.rank, rows, cols)
            accumulated = []
            for r in range(self.replicas):
                m = self.momenta[r].setdefault(name, torch.zeros_like(p))
                accumulated.append(self.beta * m + grads[r][name])
            factor = self.factors.setdefault(name, torch.zeros(rows, self.rank, dtype=p.dtype))[:, :k]
            if not factor.any():
                factor = reference_start(rows, k).to(p.dtype)
            right = sum(a.T @ factor for a in accumulated) / self.replicas
            basis = gram_schmidt(right)
            own = [a @ basis for a in accumulated]
            left = sum(own) / self.replicas
            q = left @ basis.T
            for r, a in enumerate(accumulated):
                sent = q if self.feedback == "average" else own[r] @ basis.T
                self.momenta[r][name] = a - self.alpha * sent
            self.factors[name] = torch.cat([left, torch.zeros(rows, self.rank - k, dtype=p.dtype)], dim=1)
            self.last_q[name], self.last_basis[name], self.last_right[name] = q, basis, right
            ns_input = q
            if self.shared_momentum:
                shared = self.shared.setdefault(name, torch.zeros_like(p))
                shared.copy_(self.beta * shared + (1 - self.beta) * q)
                ns_input = (1 - self.beta) * q + self.beta * shared if self.nesterov else shared.clone()
            self.last_input[name] = ns_input
            u = orthogonalize(ns_input, self.ns_steps, dtype=p.dtype)
            p.copy_((1 - self.lr * self.wd) * p - self.lr * update_scale(self.adjust, rows, cols) * u)


# ---------------------------------------------------------------- sign-compressed AdamW gradients (issue 27)


def reference_sign_step(errors: list[torch.Tensor], grads: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """One step of error-feedback sign compression with per-row scales over R replicas, for one
    tensor (rows: every dimension but the last), from the description of docs/demo.md: per
    replica x = e + g (fp32, one IEEE addition as every implementation rounds it), the scale of
    a row the mean of |x| over it (float64 here), the sign +1 where x ≥ 0 and −1 elsewhere; the
    gradient AdamW gets is the replicas' mean of scale·sign; each replica keeps x − scale·sign.
    Returns (average, new errors, scales), all float64."""
    sent, new_errors, scales = [], [], []
    for e, g in zip(errors, grads):
        x = (e.float() + g.float()).double()
        rows = x.reshape(-1, x.shape[-1])
        scale = rows.abs().sum(dim=1) / rows.shape[1]
        signs = torch.where(rows >= 0, 1.0, -1.0).to(torch.float64)
        decoded = (signs * scale[:, None]).reshape(x.shape)
        sent.append(decoded)
        new_errors.append(x - decoded)
        scales.append(scale)
    return sum(sent) / len(sent), new_errors, scales
