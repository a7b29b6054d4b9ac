"""Start Muon's outbound traffic during backward.

FSDP2 fires a parameter's post-accumulate-grad hook as soon as its gradient shard has been
reduce-scattered. Once every parameter of a bucket has fired, the bucket's raw gradient rows
and previous-momentum rows leave for their owners on a process group of their own, so the
transfer runs under the rest of backward instead of inside ``step()``.

What leaves early is the raw gradient; ``step()`` may see another one: gradient clipping
scales all gradients by c, known only after backward; gradient accumulation fires the hooks
again on the next micro-batch (the bucket is sent again and the last send wins). The owner
needs M_t = μ·M_{t−1} + (1−μ)·g_t, which is linear in g, so one global factor is enough:
``step()`` estimates c = ⟨g_final, g_sent⟩ / ⟨g_sent, g_sent⟩ over all ranks, and every rank
checks g_final == c·g_sent on its own rows. A mismatch anywhere (a per-parameter change, a
gradient touched after its hook) sends every rank back to the plain path for that step.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch import Tensor

from titan_muon.plan import offsets
from titan_muon.transport import Exchange, Transport
from titan_muon.update import local_shard


class BackwardOverlap:
    def __init__(self, optimizer, transport: Transport):
        self.opt = optimizer
        self.transport = transport
        plan = optimizer.plan
        self.bucket_entries: list[dict[int, object]] = [
            {id(optimizer._unit_param[u]): optimizer._unit_param[u] for u in bucket} for bucket in plan.buckets
        ]
        self.buckets_of: dict[int, list[int]] = defaultdict(list)
        for b, entries in enumerate(self.bucket_entries):
            for key in entries:
                self.buckets_of[key].append(b)
        self.fired: list[set[int]] = [set() for _ in plan.buckets]
        self.launches: dict[int, list[tuple[Exchange, Tensor]]] = defaultdict(list)
        self.handles = []
        self._rows: dict[int, tuple[Tensor, Tensor] | None] = {}  # per step: _sent_and_final, computed once
        for entries in self.bucket_entries:
            for entry in entries.values():
                if not any(h[0] is entry for h in self.handles):
                    hook = entry.param.register_post_accumulate_grad_hook(lambda p, entry=entry: self._on_grad_ready(entry))
                    self.handles.append((entry, hook))

    def remove(self) -> None:
        for _, hook in self.handles:
            hook.remove()
        self.handles = []

    # -------------------------------------------------------------- backward

    def _on_grad_ready(self, entry) -> None:
        key = id(entry)
        for b in self.buckets_of[key]:
            self.fired[b].add(key)
            if len(self.fired[b]) == len(self.bucket_entries[b]):
                self.fired[b].clear()
                self._launch(b)

    def _launch(self, bucket: int) -> None:
        entries = self.bucket_entries[bucket].values()
        grads = {id(e): local_shard(e.param.grad) for e in entries}
        momenta = {}
        for e in entries:
            state = self.opt.state.get(e.param)
            momenta[id(e)] = self.opt.storage.load(state) if state else torch.zeros_like(grads[id(e)])
        send = self.opt._pack(bucket, [grads, momenta])
        rank = self.transport.rank
        counts_out = [2 * c for c in self.opt.plan.send_counts(bucket, rank)]
        counts_in = [2 * c for c in self.opt.plan.recv_counts(bucket, rank)]
        self.launches[bucket].append((self.transport.all_to_all(send, counts_out, counts_in), send))

    # ------------------------------------------------------------------ step

    def launch_counts(self) -> list[int]:
        return [len(self.launches.get(b, ())) for b in range(len(self.fired))]

    def _sent_and_final(self, bucket: int) -> tuple[Tensor, Tensor] | None:
        """The raw gradient rows last sent for `bucket` and the final gradient rows, same layout.

        None if a gradient of the bucket has been removed since it was sent.
        """
        if bucket not in self._rows:
            self._rows[bucket] = self._compute_sent_and_final(bucket)
        return self._rows[bucket]

    def _compute_sent_and_final(self, bucket: int) -> tuple[Tensor, Tensor] | None:
        entries = self.bucket_entries[bucket].values()
        if any(e.param.grad is None for e in entries):
            return None
        _, send = self.launches[bucket][-1]
        counts = self.opt.plan.send_counts(bucket, self.transport.rank)
        starts = offsets([2 * c for c in counts])  # per owner: gradient rows, then momentum rows
        sent = torch.cat([send[s : s + c] for s, c in zip(starts, counts)])
        final = self.opt._pack(bucket, [{id(e): local_shard(e.param.grad) for e in entries}])
        return sent.double(), final.double()  # float64: the scale estimate must be exact to fp32 precision

    def scale_sums(self) -> tuple[float, float]:
        """Local ⟨g_final, g_sent⟩ and ⟨g_sent, g_sent⟩ over launched buckets."""
        dot = norm = 0.0
        for b in self.launches:
            rows = self._sent_and_final(b)
            if rows is None:
                continue
            sent, final = rows
            dot += float(final @ sent)
            norm += float(sent @ sent)
        return dot, norm

    def matches(self, scale: float) -> bool:
        """Does g_final == scale · g_sent hold on this rank's rows, to the wire dtype's precision?"""
        tolerance = 4 * torch.finfo(self.opt.comm_dtype).eps
        for b in self.launches:
            rows = self._sent_and_final(b)
            if rows is None:
                return False
            sent, final = rows
            if sent.numel() and (final - scale * sent).abs().max() > tolerance * max(final.abs().max(), sent.abs().max()):
                return False
        return True

    def take(self) -> dict[int, Tensor]:
        """Wait for every send of this step; the last one of each bucket is what counts."""
        arrived = {b: [exchange.wait() for exchange, _ in sends][-1] for b, sends in self.launches.items()}
        self.launches.clear()
        self._rows.clear()
        for fired in self.fired:
            fired.clear()
        return arrived
