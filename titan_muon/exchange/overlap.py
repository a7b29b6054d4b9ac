"""Send Muon's gradients to their owners during backward.

With ``overlap=True`` each sharded matrix's momentum lives whole on its owner, so the only
thing a rank must send is its gradient pieces — and FSDP2 has those as soon as it fires a
parameter's post-accumulate-grad hook, long before ``step()``. When every parameter of a
round has fired, the round leaves for its owners on the exchange engine's outbound lane (a
communicator of its own, so it never queues behind FSDP's collectives), in fp32: momentum
is an fp32 accumulator, and ``overlap=False`` builds it from fp32 gradients too. Owners round
the Nesterov input to the wire dtype, as the shard-side path does, so both modes run
Newton–Schulz on the same matrices.

What left early may not be what ``step()`` sees:

* gradient clipping scales every gradient by c, known only after backward. Momentum is
  linear in g, so the owner uses c·g_sent; c is measured per matrix, so per-parameter
  scalings are exact too;
* gradient accumulation fires the hooks once per micro-batch. The round is sent on the
  firing that completed it last step (learned, so one send per step once warmed up); a later
  firing replaces the send (the superseded one is waited for and freed).

Transfers on one communicator pair up by their order, so every rank must start the same
transfers in the same order, even when ranks differ (a gradient present on some ranks only,
another number of micro-batches). Rounds therefore leave in one order common to all ranks:
``order``, then again for each later firing (a "wave" per micro-batch until the number of
firings that completes a round is learned). A round leaves when it and every round before
it in that sequence are complete, so what each rank started is a prefix of the same
sequence. In ``step()`` the ranks compare how far they got; if they differ, the ranks behind
start the rest with zeros, every transfer is waited for and dropped, and the step sends
everything itself, or raises the same error on every rank, never leaving a transfer without
its peer. Both ``order`` (the order in which rounds completed) and the firings are learned
from the step's all-reduce, only when they were the same on every rank, so all ranks keep
the same ones.

To check that g_final == c·g_sent without keeping g_sent, each rank records four sums of its
rows of every matrix at send time — Σg, Σ(row+1)·g, Σ(col+1)·g (global indices) and Σg² —
and again in ``step()``. Summed over ranks (in the step's one all-reduce), c = √(Σg_final² /
Σg_sent²), and each linear sum must scale by c within its rounding bound: any change other
than a per-matrix scaling (a gradient modified after its hook, another micro-batch) fails
the check, and that round is sent again from ``step()``. The check costs O(1) memory and
traffic per matrix and one pass over the gradients.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

import torch
from torch import Tensor

from titan_muon.exchange.engine import ExchangeEngine, MemoryAccount, StepFailure
from titan_muon.exchange.redistribute import local_piece
from titan_muon.exchange.transport import Exchange
from titan_muon.timing import phase

SUMS = 4  # Σg, Σ(row+1)g, Σ(col+1)g, Σg²

def gradient_sums(grad: Tensor, first_row: int, first_col: int) -> Tensor:
    """Σg, Σ(row+1)·g, Σ(col+1)·g, Σg² of a (matrices, rows, cols) block, in float64.

    Rows and columns are numbered globally (block offsets `first_row`, `first_col`), so the
    per-rank sums add up to the whole matrix's.
    """
    if grad.numel() == 0:
        return torch.zeros(SUMS, dtype=torch.float64, device=grad.device)
    # CPU reductions given dtype= convert their input on every pass (one float64 copy first
    # halves the time, measured); CUDA's convert on the fly, where a copy would only cost memory.
    wide = grad.double() if grad.device.type == "cpu" else grad
    rows = wide.sum(dim=(0, 2), dtype=torch.float64)
    cols = wide.sum(dim=(0, 1), dtype=torch.float64)
    row_index = torch.arange(first_row + 1, first_row + 1 + grad.shape[1], dtype=torch.float64, device=grad.device)
    col_index = torch.arange(first_col + 1, first_col + 1 + grad.shape[2], dtype=torch.float64, device=grad.device)
    square = torch.linalg.vector_norm(wide, dtype=torch.float64).square()
    return torch.stack([rows.sum(), rows @ row_index, cols @ col_index, square])


def sum_tolerances(shape: tuple[int, int, int], dtype: torch.dtype) -> list[float]:
    """Bounds on |S_final − c·S_sent| per unit of √(Σg_final²), for the three linear sums.

    g_final = c·g_sent·(1 + δ) elementwise with |δ| ≤ u (one rounding of the scaling; two if
    the caller scales twice) and c is estimated to about u, so for a weighted sum Σ w·g the
    error is at most about 2u·√(Σw²)·√(Σg_final²) (Cauchy–Schwarz). We allow 4ε = 8u.
    """
    matrices, rows, cols = shape
    eps = torch.finfo(dtype).eps

    def squares(n: int) -> float:  # Σ_{k=1..n} k²
        return n * (n + 1) * (2 * n + 1) / 6

    weights = [matrices * rows * cols, matrices * cols * squares(rows), matrices * rows * squares(cols)]
    return [4 * eps * math.sqrt(w) for w in weights]


@dataclass
class Launch:
    exchange: Exchange
    sums: Tensor  # (params of the round, SUMS) at send time
    valid: bool  # False if packing failed on this rank (its buffer travelled but will not be used)
    without_gradient: set[int] = field(default_factory=set)  # parameters sent as zeros (frozen)


@dataclass
class EarlySends:
    """What ``step()`` may use: rounds whose gradients arrived during backward, and per round
    and parameter the factor c with g_final = c·g_sent."""

    arrived: dict[int, Exchange] = field(default_factory=dict)  # step() takes each out once used: its buffers go
    scales: dict[int, dict[int, float]] = field(default_factory=dict)
    bytes_sent: int = 0
    rounds_sent: int = 0  # len(arrived) before step() took them


class BackwardOverlap:
    """Gradient hooks that start each round's outbound trip during backward.

    ``params`` are the optimizer's MuonParam entries (all of them, indexed by ``MuonParam.index``);
    ``engine`` is the exchange engine of one rank set.
    """

    def __init__(self, params, engine: ExchangeEngine):
        self.params, self.engine = params, engine
        plan = engine.plan
        self.params_of = [sorted({plan.units[u].param for u in members}) for members in plan.rounds]
        # A frozen parameter (requires_grad=False) gets no hook and no gradient: a round waits for
        # the others only (one of frozen parameters alone is sent from step()). Its pieces travel
        # as zeros, and step() leaves it alone (no gradient on any rank), as without overlap.
        self.waits_for = [[i for i in members if params[i].param.requires_grad] for members in self.params_of]
        self.rounds_of: dict[int, list[int]] = defaultdict(list)
        for r, members in enumerate(self.waits_for):
            for index in members:
                self.rounds_of[index].append(r)
        self.entries = [(r, index) for r, members in enumerate(self.params_of) for index in members]
        self.entry_start = []
        start = 0
        for members in self.params_of:
            self.entry_start.append(start)
            start += len(members)
        tolerances = [sum_tolerances(_stack_shape(params[i].param), params[i].param.dtype) for _, i in self.entries]
        self.tolerances = torch.tensor(tolerances, dtype=torch.float64, device=engine.device).reshape(-1, SUMS - 1)
        self.fires: dict[int, int] = defaultdict(int)
        self.expected = [1] * len(plan.rounds)  # hook rounds that complete a round; learned per step
        # the common launch order: rounds with a parameter to wait for, as they completed last step
        self.order = [r for r in range(len(plan.rounds)) if self.waits_for[r]]
        self.started: list[int] = []  # rounds started this step, in order: a prefix of order × waves
        self.completed: dict[int, int] = {}  # round -> position (1-based) at which it completed this step
        self.launches: dict[int, Launch] = {}
        self.bytes_sent = 0
        self.handles = [
            params[index].param.register_post_accumulate_grad_hook(lambda _, index=index: self._on_grad_ready(index))
            for index in sorted(self.rounds_of)
        ]

    @property
    def rounds(self) -> int:
        return len(self.engine.tables)

    @property
    def flags_size(self) -> int:
        """Per round "not sent" and "send failed"; the transfers started (count, square); per
        round the firings that completed it and its completion position (each with its square)."""
        return 2 * self.rounds + 2 + 4 * self.rounds

    @property
    def sums_size(self) -> int:
        return self.flags_size + 2 * len(self.entries) * SUMS

    @property
    def decision_size(self) -> int:
        return self.flags_size + 2 * len(self.entries)

    def remove(self) -> None:
        self.drain()
        for handle in self.handles:
            handle.remove()
        self.handles = []

    # -------------------------------------------------------------- backward

    def _on_grad_ready(self, index: int) -> None:
        self.fires[index] += 1
        for r in self.rounds_of[index]:
            if r not in self.completed and self._fired(r) >= self.expected[r]:
                self.completed[r] = len(self.completed) + 1
        while self.order:  # start what is complete, in the common order
            r, wave = self._next()
            if self._fired(r) < self.expected[r] + wave:
                break
            with phase("backward_send"):
                self._launch(r)
            self.started.append(r)

    def _fired(self, r: int) -> int:
        return min((self.fires[i] for i in self.waits_for[r]), default=0)

    def _next(self) -> tuple[int, int]:
        """The next round to start, and its wave (0: the firing learned to complete it)."""
        k = len(self.started)
        return self.order[k % len(self.order)], k // len(self.order)

    def _block_offsets(self, index: int) -> tuple[int, int]:
        box = self.params[index].sharding.box(self.engine.rank)
        return box[1][0], box[2][0]

    def _launch(self, r: int) -> None:
        superseded = self.launches.pop(r, None)
        if superseded is not None:  # a later micro-batch fired the hooks again
            superseded.exchange.wait()
        failure = StepFailure()  # a failed send is sent again from step(), where errors are settled
        exchange = self.engine.launch(r, torch.float32, self._fill, failure, MemoryAccount())
        tables = self.engine.tables[r]
        self.bytes_sent += 4 * (tables.send_numel - tables.send_counts[self.engine.rank])
        without = {i for i in self.params_of[r] if self.params[i].param.grad is None}
        try:
            sums = torch.stack([self._sums_now(i) for i in self.params_of[r]])
        except Exception as error:  # noqa: BLE001
            failure.record(error, "gradient sums")
            sums = torch.zeros(len(self.params_of[r]), SUMS, dtype=torch.float64, device=self.engine.device)
        self.launches[r] = Launch(exchange, sums, failure.error is None, without)

    def _fill(self, pairs: list) -> None:
        for piece, slot in pairs:
            index = self.engine.units[piece.unit].param
            if self.params[index].param.grad is None:  # frozen: zeros, as step() sends them
                slot.zero_()
            else:
                slot.copy_(local_piece(self._grad_stack(index), piece))

    def _sums_now(self, index: int) -> Tensor:
        """The sums of a parameter's gradient block; zeros without a gradient."""
        if self.params[index].param.grad is None:
            return torch.zeros(SUMS, dtype=torch.float64, device=self.engine.device)
        return gradient_sums(self._grad_stack(index), *self._block_offsets(index))

    def _grad_stack(self, index: int) -> Tensor:
        entry = self.params[index]
        return entry.stack(entry.param.grad)

    # ------------------------------------------------------------------ step

    def gradient_sums(self) -> Tensor:
        """This rank's part of the step's all-reduce: the flags (:attr:`flags_size`), then per
        (round, parameter) the sums at send time and now."""
        device = self.engine.device
        unsent = torch.ones(self.rounds, dtype=torch.float64, device=device)
        failed = torch.zeros(self.rounds, dtype=torch.float64, device=device)
        sent = torch.zeros(len(self.entries), SUMS, dtype=torch.float64, device=device)
        final = torch.zeros(len(self.entries), SUMS, dtype=torch.float64, device=device)
        if self.launches:
            now = {}
            for index in {i for r in self.launches for i in self.params_of[r]}:
                if self.params[index].param.grad is not None:
                    now[index] = gradient_sums(self._grad_stack(index), *self._block_offsets(index))
            for r, launch in self.launches.items():
                start, members = self.entry_start[r], self.params_of[r]
                unsent[r] = 0.0
                # a gradient gone since the send fails the round; one that appeared is a mismatch
                if not launch.valid or any(i not in now and i not in launch.without_gradient for i in members):
                    failed[r] = 1.0
                    continue
                sent[start : start + len(members)] = launch.sums
                final[start : start + len(members)] = torch.stack([now[i] if i in now else launch.sums[k]
                                                                   for k, i in enumerate(members)])  # fmt: skip
        started = float(len(self.started))
        fired = [float(self._fired(r)) for r in range(self.rounds)]
        position = [float(self.completed.get(r, 0)) for r in range(self.rounds)]
        learned = torch.tensor([started, started**2, *fired, *(f * f for f in fired), *position, *(q * q for q in position)],
                               dtype=torch.float64, device=device)  # fmt: skip
        return torch.cat([unsent, failed, learned, sent.reshape(-1), final.reshape(-1)])

    def compare(self, reduced: Tensor) -> Tensor:
        """On the device, from the all-reduced sums: the flags, per (round, parameter) whether
        g_final ≠ c·g_sent and c itself."""
        flags_size, entries = self.flags_size, len(self.entries)
        flags = reduced[:flags_size]
        sent = reduced[flags_size : flags_size + entries * SUMS].view(entries, SUMS)
        final = reduced[flags_size + entries * SUMS :].view(entries, SUMS)
        square_sent, square_final = sent[:, 3], final[:, 3]
        scale = torch.where(square_sent > 0, (square_final / square_sent.clamp(min=1e-300)).sqrt(), torch.ones_like(square_sent))
        error = (final[:, :3] - scale[:, None] * sent[:, :3]).abs()
        bound = self.tolerances * square_final.sqrt()[:, None]
        mismatch = (error > bound).any(dim=1) | ((square_sent == 0) & (square_final > 0)) | ~torch.isfinite(scale)
        return torch.cat([flags, mismatch.double(), scale])

    def decide(self, host: list[float], world: int, usable: bool = True) -> EarlySends:
        """Which early sends ``step()`` uses (the same decision on every rank); waits for and
        drops the others — all of them if the step will not run (not `usable`), or if the
        ranks started different numbers of transfers during backward: then the ranks behind
        first start the rest of the common sequence with zeros (one MAX all-reduce), so every
        transfer has its peer, and ``step()`` sends every round itself."""
        rounds, entries, flags_size = self.rounds, len(self.entries), self.flags_size
        unsent, failed = host[:rounds], host[rounds : 2 * rounds]
        started_total, started_square = host[2 * rounds : 2 * rounds + 2]
        learned = host[2 * rounds + 2 : flags_size]
        mismatch, scale = host[flags_size : flags_size + entries], host[flags_size + entries :]
        if world * started_square != started_total**2 or any(0 < unsent[r] < world for r in range(rounds)):
            self._catch_up()
            self.drain(learned, world)
            return EarlySends()
        early = EarlySends(bytes_sent=self.bytes_sent)
        for r, launch in self.launches.items():
            start, members = self.entry_start[r], self.params_of[r]
            if usable and failed[r] == 0 and not any(mismatch[start : start + len(members)]):
                early.arrived[r] = launch.exchange
                early.scales[r] = dict(zip(members, scale[start : start + len(members)]))
                early.rounds_sent += 1
            else:
                launch.exchange.wait()
        self._end_step(learned, world)
        return early

    def _catch_up(self) -> None:
        """Start, with zeros, what the furthest rank started beyond this one (the same rounds in
        the same order: every rank's transfers are a prefix of one sequence)."""
        device = self.engine.device
        furthest = self.engine.back.all_reduce(torch.tensor([float(len(self.started))], dtype=torch.float64, device=device),
                                               torch.distributed.ReduceOp.MAX)  # fmt: skip
        for _ in range(len(self.started), int(furthest.item())):
            r, _wave = self._next()
            superseded = self.launches.pop(r, None)
            if superseded is not None:
                superseded.exchange.wait()
            exchange = self.engine.launch(r, torch.float32, lambda pairs: [slot.zero_() for _, slot in pairs], StepFailure(), MemoryAccount())
            self.launches[r] = Launch(exchange, torch.zeros(0, dtype=torch.float64, device=device), False)
            self.started.append(r)

    def drain(self, learned: list[float] | None = None, world: int = 1) -> None:
        """Wait for and drop every send of this step (error and skip paths)."""
        for launch in self.launches.values():
            launch.exchange.wait()
        self._end_step(learned, world)

    def _end_step(self, learned: list[float] | None = None, world: int = 1) -> None:
        """Forget this step's sends; with `learned` (the all-reduced firings and completion
        positions per round), keep for the next step what was the same on every rank: the
        firing that completed each round, and the order in which the rounds completed."""
        if learned is not None:
            rounds = self.rounds
            fired, fired_square = learned[:rounds], learned[rounds : 2 * rounds]
            position, position_square = learned[2 * rounds : 3 * rounds], learned[3 * rounds :]
            for r in range(rounds):
                if fired[r] > 0 and world * fired_square[r] == fired[r] ** 2:
                    self.expected[r] = round(fired[r] / world)
            if all(position[r] > 0 and world * position_square[r] == position[r] ** 2 for r in self.order):
                self.order = sorted(self.order, key=lambda r: position[r])
        self.launches.clear()
        self.fires.clear()
        self.started, self.completed = [], {}
        self.bytes_sent = 0


def metrics(early: list) -> dict[str, float]:
    sends = [e for e in early if e is not None]
    if not sends:
        return {}
    return {
        "muon/bytes_sent_in_backward": float(sum(e.bytes_sent for e in sends)),
        "muon/rounds_sent_in_backward": float(sum(e.rounds_sent for e in sends)),
    }


def _stack_shape(param: Tensor) -> tuple[int, int, int]:
    return (1, *param.shape) if param.ndim == 2 else tuple(param.shape)
