"""How far does low-precision Muon momentum drift from fp32? Measured on CPU in about a minute.

    python scripts/measure_fp8_momentum.py                # 200 steps, prints markdown tables
    python scripts/measure_fp8_momentum.py --steps 50

Three experiments, each comparing every storage variant with an fp32 momentum:
  replay     a small MLP student learns a noisy teacher with fp32 Muon (batch 32); each
             variant's momentum is fed the same minibatch gradients, so only storage differs.
             Reported: ||M - M_fp32|| / ||M_fp32|| over both matrices at step 50 and at the
             end, and the same for the orthogonalized momentum (what the update uses).
  signal     gradients = slowly rotating signal + 10 % noise: the case where round-to-nearest
             stagnates (small momentum increments round back to the old value).
  training   each variant's momentum drives its own training run; the final loss
             (mean of the last 20 steps) against fp32.
"""

from __future__ import annotations

import argparse
import time

import torch

from titan_muon.algorithm.newton_schulz import orthogonalize
from titan_muon.state.momentum import momentum_storage

BETA = 0.95
SHAPES = ((128, 512), (32, 128))  # the MLP's two matrices: d_in 512, hidden 128, d_out 32


class Plain:
    """A storage variant: momentum_storage(...) as the optimizer would use it."""

    def __init__(self, label, dtype, **kwargs):
        self.label, self.storage = label, momentum_storage(dtype, **kwargs)

    def create(self, shape):
        return self.storage.create(torch.zeros(shape))

    def load(self, state):
        return self.storage.load(state)

    def store(self, state, m, stream):
        self.storage.store(state, m, stream)

    def bytes(self, shape):
        return self.storage.bytes_per_element(*shape)


class WithResidual(Plain):
    """fp8 momentum plus its rounding residual in a second tensor: M = q + r.

    The residual r = M - q is stored too (bf16 or fp8), so only r's rounding error is
    lost each step. Costs the residual's bytes on top of fp8's.
    """

    def __init__(self, label, residual_dtype):
        super().__init__(label, "fp8", rounding="nearest")
        self.residual = momentum_storage(residual_dtype, rounding="nearest")

    def create(self, shape):
        return {"q": super().create(shape), "r": self.residual.create(torch.zeros(shape))}

    def load(self, state):
        return self.storage.load(state["q"]) + self.residual.load(state["r"])

    def store(self, state, m, stream):
        self.storage.store(state["q"], m, stream)
        self.residual.store(state["r"], m - self.storage.load(state["q"]), stream)

    def bytes(self, shape):
        return self.storage.bytes_per_element(*shape) + self.residual.bytes_per_element(*shape)


def variants():
    return [
        Plain("fp32", "fp32"),
        Plain("bf16, nearest", "bf16"),
        Plain("bf16, stochastic", "bf16", rounding="stochastic"),
        Plain("fp8 row, nearest", "fp8", rounding="nearest", block_cols=1 << 30),
        Plain("fp8 block 256, nearest", "fp8", rounding="nearest", block_cols=256),
        Plain("fp8 row, stochastic", "fp8", rounding="stochastic", block_cols=1 << 30),
        Plain("fp8 block 256, stochastic", "fp8", rounding="stochastic", block_cols=256),
        WithResidual("fp8 block 256 + fp8 residual", "fp8"),
        WithResidual("fp8 block 256 + bf16 residual", "bf16"),
    ]


def relative_error(ms, refs):
    num = sum(float((m - r).square().sum()) for m, r in zip(ms, refs))
    den = sum(float(r.square().sum()) for r in refs)
    return (num / den) ** 0.5


def ortho(m):
    return orthogonalize(m, 5, "keller", torch.float32, 1e-7)


class Task:
    """Student MLP x -> W2 relu(W1 x) fitting a fixed noisy teacher on fresh minibatches."""

    def __init__(self, seed):
        g = torch.Generator().manual_seed(seed)
        self.teacher = [torch.randn(s, generator=g) / s[1] ** 0.5 for s in SHAPES]
        self.init = [torch.randn(s, generator=g) / s[1] ** 0.5 for s in SHAPES]
        self.seed = seed

    def grads(self, weights, step):
        g = torch.Generator().manual_seed(self.seed * 100_003 + step)
        x = torch.randn(32, SHAPES[0][1], generator=g)
        y = torch.relu(x @ self.teacher[0].T) @ self.teacher[1].T + 0.1 * torch.randn(32, SHAPES[1][0], generator=g)
        w = [t.clone().requires_grad_() for t in weights]
        loss = (torch.relu(x @ w[0].T) @ w[1].T - y).square().mean()
        loss.backward()
        return [t.grad for t in w], loss.item()


def muon_update(weights, momenta, grads, lr=0.02):
    for w, m, g in zip(weights, momenta, grads):
        w.sub_(ortho(g.lerp(m, BETA)), alpha=lr)  # Nesterov; both shapes are wide: scale 1


def replay(task, steps, vs):
    weights = [t.clone() for t in task.init]
    ref = [torch.zeros(s) for s in SHAPES]
    states = [[v.create(s) for s in SHAPES] for v in vs]
    early = {}
    for step in range(steps):
        grads, _ = task.grads(weights, step)
        for r, g in zip(ref, grads):
            r.lerp_(g, 1 - BETA)
        for v, st in zip(vs, states):
            for i, (s, g) in enumerate(zip(st, grads)):
                m = v.load(s)
                m.lerp_(g, 1 - BETA)
                v.store(s, m, i)
        if step + 1 == min(50, steps):
            early = {v.label: relative_error([v.load(s) for s in st], ref) for v, st in zip(vs, states)}
        muon_update(weights, ref, grads)
    out = {}
    for v, st in zip(vs, states):
        ms = [v.load(s) for s in st]
        once = relative_error([_round_trip(v, r) for r in ref], ref)
        out[v.label] = (early[v.label], relative_error(ms, ref), relative_error([ortho(m) for m in ms], [ortho(r) for r in ref]), once)
    return out


def _round_trip(v, m):
    state = v.create(m.shape)
    v.store(state, m.clone(), 0)
    return v.load(state)


def signal(steps, vs, seed):
    g = torch.Generator().manual_seed(seed)
    a, b = (torch.randn(SHAPES[0], generator=g) for _ in range(2))
    ref = torch.zeros(SHAPES[0])
    states = [v.create(SHAPES[0]) for v in vs]
    for step in range(steps):
        angle = 2 * torch.pi * step / (4 * steps)  # a quarter turn over the run
        grad = a * float(torch.cos(torch.tensor(angle))) + b * float(torch.sin(torch.tensor(angle)))
        grad += 0.1 * torch.randn(SHAPES[0], generator=g)
        ref.lerp_(grad, 1 - BETA)
        for v, s in zip(vs, states):
            m = v.load(s)
            m.lerp_(grad, 1 - BETA)
            v.store(s, m, 0)
    return {v.label: relative_error([v.load(s)], [ref]) for v, s in zip(vs, states)}


def training(task, steps, vs):
    out = {}
    for v in vs:
        weights = [t.clone() for t in task.init]
        states = [v.create(s) for s in SHAPES]
        losses = []
        for step in range(steps):
            grads, loss = task.grads(weights, step)
            losses.append(loss)
            momenta = []
            for i, (s, g) in enumerate(zip(states, grads)):
                m = v.load(s)
                m.lerp_(g, 1 - BETA)
                v.store(s, m, i)
                momenta.append(m)
            muon_update(weights, momenta, grads)
        out[v.label] = sum(losses[-20:]) / len(losses[-20:])
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    started = time.perf_counter()
    vs = variants()
    task = Task(args.seed)
    rep = replay(task, args.steps, vs)
    sig = signal(args.steps, vs, args.seed)
    train = training(task, args.steps, vs)
    base = train["fp32"]

    print(f"torch {torch.__version__}, {args.steps} steps, beta {BETA}, matrices {SHAPES}, seed {args.seed}\n")
    print(
        "| momentum storage | B/param 1024² | B/param 128×512 | one round trip | "
        f"momentum err @50 | momentum err @{args.steps} | orthogonalized err @{args.steps} | "
        f"signal+noise err @{args.steps} | final loss (fp32 {base:.4f}) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for v in vs:
        e50, end, orth, once = rep[v.label]
        print(
            f"| {v.label} | {v.bytes((1024, 1024)):.4f} | {v.bytes(SHAPES[0]):.4f} | {100 * once:.2f} % | "
            f"{100 * e50:.2f} % | {100 * end:.2f} % | {100 * orth:.2f} % | {100 * sig[v.label]:.2f} % | "
            f"{train[v.label]:.4f} ({100 * (train[v.label] / base - 1):+.2f} %) |"
        )
    print(f"\n({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
