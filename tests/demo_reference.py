"""Independent one-process reference of DeMo-Muon (seed 002) over R simulated replicas.

Written from the paper's description, not from titan_muon.demo.dct: one chunk at a time in a plain
loop, its own DCT-II matrix from the definition (double loop), selection by Python's sort on
(−|c|, position), kept count per chunk from exact fractions, and each replica's sent part
decoded on its own before the average. Only Newton–Schulz and the update scale come from
titan_muon, as the brief asks (they are not what is under test here).
"""

from __future__ import annotations

import math
from fractions import Fraction

import torch

from titan_muon.algorithm.newton_schulz import orthogonalize
from titan_muon.algorithm.update import update_scale


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
