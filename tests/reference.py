"""Independent plain-fp32 references: the math of Muon and AdamW on whole tensors, one process.

Written from the published formulas, not from titan_muon's modules, so agreement means
something.
"""

from __future__ import annotations

import math

import torch

KELLER = (3.4445, -4.7750, 2.0315)


def reference_ns(g: torch.Tensor, steps: int = 5, coefficients=KELLER, eps: float = 1e-7) -> torch.Tensor:
    x = g.double().float()
    transposed = x.shape[0] > x.shape[1]
    if transposed:
        x = x.T
    x = x / max(x.norm().item(), eps)
    a, b, c = coefficients
    for _ in range(steps):
        A = x @ x.T
        x = a * x + (b * A + c * (A @ A)) @ x
    return x.T if transposed else x


class ReferenceMuonAdamW:
    """state per tensor name; `muon` maps names to True (Muon) or False (AdamW)."""

    def __init__(self, lr, weight_decay, momentum=0.95, nesterov=True, ns_steps=5, adjust_lr_fn=None,
                 adamw_lr=None, betas=(0.9, 0.95), eps=1e-8, adamw_weight_decay=None):
        self.lr, self.wd, self.mu, self.nesterov, self.steps = lr, weight_decay, momentum, nesterov, ns_steps
        self.adjust = adjust_lr_fn
        self.adamw_lr = lr if adamw_lr is None else adamw_lr
        self.adamw_wd = weight_decay if adamw_weight_decay is None else adamw_weight_decay
        self.betas, self.eps = betas, eps
        self.state: dict[str, dict] = {}

    def step(self, params: dict[str, torch.Tensor], grads: dict[str, torch.Tensor], muon: dict[str, bool]) -> None:
        for name, p in params.items():
            g = grads[name]
            st = self.state.setdefault(name, {})
            if muon[name]:
                m = st.setdefault("m", torch.zeros_like(p))
                m.mul_(self.mu).add_(g, alpha=1 - self.mu)
                u = (1 - self.mu) * g + self.mu * m if self.nesterov else m
                o = reference_ns(u, self.steps)
                A, B = p.shape
                if self.adjust == "match_rms_adamw":
                    ratio = 0.2 * math.sqrt(max(A, B))
                elif self.adjust == "spectral_unclamped":  # torchtitan 0.3.0 DistMuon: sqrt(fan_out / fan_in)
                    ratio = math.sqrt(A / B)
                else:
                    ratio = math.sqrt(max(1, A / B))
                p.mul_(1 - self.lr * self.wd).sub_(self.lr * ratio * o)
            else:
                b1, b2 = self.betas
                t = st["t"] = st.get("t", 0) + 1
                m = st.setdefault("m", torch.zeros_like(p))
                v = st.setdefault("v", torch.zeros_like(p))
                m.mul_(b1).add_(g, alpha=1 - b1)
                v.mul_(b2).addcmul_(g, g, value=1 - b2)
                p.mul_(1 - self.adamw_lr * self.adamw_wd)
                denom = (v / (1 - b2**t)).sqrt() + self.eps
                p.sub_(self.adamw_lr * (m / (1 - b1**t)) / denom)
