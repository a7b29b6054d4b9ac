"""Send Muon's gradients to their owners during backward.

With ``overlap=True`` each sharded matrix's momentum lives whole on its owner, so the only
thing a rank must send is its gradient pieces — and FSDP2 has those as soon as it fires a
parameter's post-accumulate-grad hook, long before ``step()``. When every parameter of a
bucket has fired, the bucket leaves for its owners on a process group of its own (so it
never queues behind FSDP's collectives), with exactly the bytes ``step()`` would send.

What left early may not be what ``step()`` sees:

* gradient clipping scales every gradient by c, known only after backward. Momentum is
  linear in g, so the owner uses c·g_sent; c is measured per matrix, so per-parameter
  scalings are exact too;
* gradient accumulation fires the hooks once per micro-batch. The bucket is sent on the
  firing that completed it last step (learned, so one send per step once warmed up); a later
  firing replaces the send (the superseded one is waited for and freed).

To check that g_final == c·g_sent without keeping g_sent, each rank records four sums of its
rows of every matrix at send time — Σg, Σ(row+1)·g, Σ(col+1)·g (global indices) and Σg² —
and again in ``step()``. Summed over ranks (in the step's one all-reduce), c = √(Σg_final² /
Σg_sent²), and each linear sum must scale by c within its rounding bound: any change other
than a per-matrix scaling (a gradient modified after its hook, another micro-batch) fails
the check, and that bucket is sent again from ``step()``. The check costs O(1) memory and
traffic per matrix and one pass over the gradients.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

import torch
from torch import Tensor

from titan_muon.plan import BucketSchedule, Plan
from titan_muon.redistribute import local_views, pack
from titan_muon.timing import phase
from titan_muon.transport import Exchange, Transport

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
    sums: Tensor  # (params of the bucket, SUMS) at send time
    valid: bool  # False if packing failed on this rank (zeros were sent)


@dataclass
class EarlySends:
    """What ``step()`` may use: buckets whose gradients arrived during backward, and per
    bucket and parameter the factor c with g_final = c·g_sent."""

    arrived: dict[int, Exchange] = field(default_factory=dict)
    scales: dict[int, dict[int, float]] = field(default_factory=dict)
    bytes_sent: int = 0


class BackwardOverlap:
    """Gradient hooks that start each bucket's outbound all-to-all during backward.

    ``params`` are the optimizer's MuonParam entries; ``schedules`` this rank's bucket
    tables; ``transport`` runs on the twin group.
    """

    def __init__(self, params, plan: Plan, schedules: tuple[BucketSchedule, ...], transport: Transport, comm_dtype: torch.dtype):
        self.params, self.plan, self.schedules = params, plan, schedules
        self.transport, self.comm_dtype = transport, comm_dtype
        self.params_of = [sorted({plan.units[u].param for u in bucket}) for bucket in plan.buckets]
        self.buckets_of: dict[int, list[int]] = defaultdict(list)
        for b, members in enumerate(self.params_of):
            for index in members:
                self.buckets_of[index].append(b)
        self.entries = [(b, index) for b, members in enumerate(self.params_of) for index in members]
        self.entry_start = []
        start = 0
        for members in self.params_of:
            self.entry_start.append(start)
            start += len(members)
        device = transport.device
        tolerances = [sum_tolerances(_stack_shape(params[i].param), params[i].param.dtype) for _, i in self.entries]
        self.tolerances = torch.tensor(tolerances, dtype=torch.float64, device=device).reshape(-1, SUMS - 1)
        self.fires: dict[int, int] = defaultdict(int)
        self.expected = [1] * len(plan.buckets)  # hook rounds that complete a bucket; learned per step
        self.sent_round = [0] * len(plan.buckets)
        self.launches: dict[int, Launch] = {}
        self.bytes_sent = 0
        self.handles = [
            params[index].param.register_post_accumulate_grad_hook(lambda _, index=index: self._on_grad_ready(index))
            for index in sorted(self.buckets_of)
        ]

    def remove(self) -> None:
        self.drain()
        for handle in self.handles:
            handle.remove()
        self.handles = []

    # -------------------------------------------------------------- backward

    def _on_grad_ready(self, index: int) -> None:
        self.fires[index] += 1
        for b in self.buckets_of[index]:
            rounds = min(self.fires[i] for i in self.params_of[b])
            if rounds >= self.expected[b] and rounds > self.sent_round[b]:
                self.sent_round[b] = rounds
                with phase("backward_send"):
                    self._launch(b)

    def _block_offsets(self, index: int) -> tuple[int, int]:
        entry = self.params[index]
        box = entry.sharding.box(self.transport.rank)
        return box[1][0], box[2][0]

    def _launch(self, bucket: int) -> None:
        superseded = self.launches.pop(bucket, None)
        if superseded is not None:  # a later micro-batch fired the hooks again
            superseded.exchange.wait()
        schedule = self.schedules[bucket]
        try:
            grads = local_views(schedule.outbound, lambda p: self._grad_stack(self.plan.units[p.unit].param))
            send = pack(grads, self.comm_dtype, self.transport.device)
            sums = torch.stack([gradient_sums(self._grad_stack(i), *self._block_offsets(i)) for i in self.params_of[bucket]])
            valid = True
        except Exception:  # noqa: BLE001 - the bucket is sent again from step(), where errors are settled collectively
            send = torch.zeros(schedule.send_numel, dtype=self.comm_dtype, device=self.transport.device)
            sums = torch.zeros(len(self.params_of[bucket]), SUMS, dtype=torch.float64, device=self.transport.device)
            valid = False
        exchange = self.transport.all_to_all(send, schedule.send_counts, schedule.recv_counts)
        self.launches[bucket] = Launch(exchange, sums, valid)

    def _grad_stack(self, index: int) -> Tensor:
        entry = self.params[index]
        return entry.stack(entry.param.grad)

    # ------------------------------------------------------------------ step

    def gradient_sums(self) -> Tensor:
        """This rank's part of the step's all-reduce: per bucket "not sent" and "send failed"
        flags, then per (bucket, parameter) the sums at send time and now."""
        device = self.transport.device
        buckets = len(self.schedules)
        unsent = torch.ones(buckets, dtype=torch.float64, device=device)
        failed = torch.zeros(buckets, dtype=torch.float64, device=device)
        sent = torch.zeros(len(self.entries), SUMS, dtype=torch.float64, device=device)
        final = torch.zeros(len(self.entries), SUMS, dtype=torch.float64, device=device)
        if self.launches:
            now = {}
            for index in {i for b in self.launches for i in self.params_of[b]}:
                if self.params[index].param.grad is not None:
                    now[index] = gradient_sums(self._grad_stack(index), *self._block_offsets(index))
            for b, launch in self.launches.items():
                start, members = self.entry_start[b], self.params_of[b]
                unsent[b] = 0.0
                if not launch.valid or any(i not in now for i in members):
                    failed[b] = 1.0
                    continue
                sent[start : start + len(members)] = launch.sums
                final[start : start + len(members)] = torch.stack([now[i] for i in members])
        return torch.cat([unsent, failed, sent.reshape(-1), final.reshape(-1)])

    def compare(self, reduced: Tensor) -> Tensor:
        """On the device, from the all-reduced sums: per bucket the flags, per (bucket,
        parameter) whether g_final ≠ c·g_sent and c itself."""
        buckets, entries = len(self.schedules), len(self.entries)
        flags = reduced[: 2 * buckets]
        sent = reduced[2 * buckets : 2 * buckets + entries * SUMS].view(entries, SUMS)
        final = reduced[2 * buckets + entries * SUMS :].view(entries, SUMS)
        square_sent, square_final = sent[:, 3], final[:, 3]
        scale = torch.where(square_sent > 0, (square_final / square_sent.clamp(min=1e-300)).sqrt(), torch.ones_like(square_sent))
        error = (final[:, :3] - scale[:, None] * sent[:, :3]).abs()
        bound = self.tolerances * square_final.sqrt()[:, None]
        mismatch = (error > bound).any(dim=1) | ((square_sent == 0) & (square_final > 0)) | ~torch.isfinite(scale)
        return torch.cat([flags, mismatch.double(), scale])

    def decide(self, host: list[float], world: int, usable: bool = True) -> EarlySends:
        """Which early sends ``step()`` uses (the same decision on every rank); waits for and
        drops the others — all of them if the step will not run (not `usable`)."""
        buckets, entries = len(self.schedules), len(self.entries)
        unsent, failed = host[:buckets], host[buckets : 2 * buckets]
        mismatch, scale = host[2 * buckets : 2 * buckets + entries], host[2 * buckets + entries :]
        uneven = [b for b in range(buckets) if 0 < unsent[b] < world]
        if uneven:
            raise RuntimeError(
                f"titan_muon.Muon: gradient hooks completed buckets {uneven} on some ranks but not on others during "
                "backward, so the transfers started then cannot be matched (this happens when ranks leave different "
                "parameters unused). Build the optimizer with overlap=False."
            )
        early = EarlySends(bytes_sent=self.transport.bytes_sent)
        for b, launch in self.launches.items():
            start, members = self.entry_start[b], self.params_of[b]
            if usable and failed[b] == 0 and not any(mismatch[start : start + len(members)]):
                early.arrived[b] = launch.exchange
                early.scales[b] = dict(zip(members, scale[start : start + len(members)]))
            else:
                launch.exchange.wait()
        self._end_step()
        return early

    def drain(self) -> None:
        """Wait for and drop every send of this step (error and skip paths)."""
        for launch in self.launches.values():
            launch.exchange.wait()
        self._end_step()

    def _end_step(self) -> None:
        for b in range(len(self.schedules)):
            rounds = min(self.fires[i] for i in self.params_of[b])
            if rounds:  # next step, send on the firing that completed the bucket this time
                self.expected[b] = rounds
        self.launches.clear()
        self.fires.clear()
        self.sent_round = [0] * len(self.schedules)
        self.transport.bytes_sent = self.transport.bytes_received = 0

    def metrics(self, early: EarlySends | None) -> dict[str, float]:
        if early is None:
            return {}
        return {"muon/bytes_sent_in_backward": float(early.bytes_sent), "muon/buckets_sent_in_backward": float(len(early.arrived))}


def _stack_shape(param: Tensor) -> tuple[int, int, int]:
    return (1, *param.shape) if param.ndim == 2 else tuple(param.shape)
