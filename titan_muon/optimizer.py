"""titan_muon.Muon: Muon for 2-D hidden matrices and AdamW for the rest, in one optimizer.

One step, top-down:
  1. check gradients on every rank together (one tiny all-reduce): a missing or non-finite
     gradient stops or skips the step on all ranks alike, before any state changes;
  2. momentum and Nesterov on the local shards (element-wise, no communication);
  3. per bucket: shards go to their owners (all-to-all), each owner orthogonalizes its
     matrices once (batched by shape), the scaled updates come back (all-to-all);
  4. weight decay and the step on the local shards; AdamW for the AdamW groups.

Parameters are plain tensors (one process, or replicated) or DTensors sharded ``Shard(0)``
on one mesh dimension (FSDP2, or HSDP's shard dimension). The plan that decides owners and
buckets depends only on global shapes and the world size, so a run on W ranks computes what
the one-process run computes.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.optim import Optimizer
from torch.optim.adamw import adamw as adamw_functional

from titan_muon.overlap import BackwardOverlap
from titan_muon.newton_schulz import NS_METHODS, coefficient_schedule, newton_schulz_flops, orthogonalize
from titan_muon.plan import Plan, Unit, build_plan, offsets, shard_rows
from titan_muon.state import momentum_storage
from titan_muon.split import RowBlocks, match_row_blocks, row_block_ranges
from titan_muon.transport import Exchange, Transport
from titan_muon.update import ADJUST_LR_FNS, apply_update, local_shard, momentum_step, update_scale

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
NONFINITE_POLICIES = ("raise", "skip")


@dataclass
class _MuonParam:
    """A Muon parameter and where its rows live."""

    param: Tensor
    name: str
    group: dict  # rebound after load_state_dict, which replaces the group dicts
    group_index: int
    sharded: bool  # rows spread over the process group (else the whole matrix is local)


def _dtype(name: str, key: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"titan_muon.Muon: {key}={name!r} is not supported; expected one of {tuple(DTYPES)}")
    return DTYPES[name]


class Muon(Optimizer):
    """Muon (momentum orthogonalized by Newton–Schulz) with AdamW groups, FSDP2-native.

    Param groups with ``use_muon=True`` (the default) must hold 2-D matrices; groups with
    ``use_muon=False`` get AdamW with their own ``betas``, ``eps`` and ``weight_decay``.
    :func:`titan_muon.build_param_groups` splits a model the usual way.

    Args follow ``torch.optim.Muon`` (lr, weight_decay, momentum, nesterov, ns_coefficients,
    ns_steps, adjust_lr_fn) plus:
        ns_coefficients: "keller" (default), "polar_express", or an (a, b, c) tuple.
        ns_dtype: "fp32" (default) or "bf16": dtype of the Newton–Schulz matmuls.
        comm_dtype: "fp32" (default) or "bf16": dtype of shards on the wire.
        adamw_betas, adamw_eps: defaults for AdamW groups ("betas", "eps" group keys).
        bucket_size_mb: size of one all-to-all bucket (fp32 MiB of whole matrices).
        nonfinite_grads: "raise" (default) raises on every rank; "skip" skips the whole step
            on every rank, state untouched, counted in ``last_step_metrics``.
        row_blocks: Muon Split. Maps FQN patterns (fnmatch) to row-block sizes: an int (one
            block per attention head) or a repeating sequence (e.g. ``(q_nope, q_rope)``).
            Each block is orthogonalized on its own and scaled by its own shape.
        momentum_dtype: "fp32" (default), "bf16" or "fp8": how Muon momentum is stored (state.py);
            fp8 is e4m3 with row-following power-of-two scales and stochastic rounding, about
            1 byte per parameter, and reshards through DCP to any world size.
        overlap: start sending each bucket to its owners during backward, as soon as FSDP2 has
            reduce-scattered all its gradients (see overlap.py); same math, exact under
            gradient clipping and accumulation.
    """

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        adjust_lr_fn: str | None = None,
        *,
        ns_coefficients: str | tuple[float, float, float] = "keller",
        ns_eps: float = 1e-7,
        ns_dtype: str = "fp32",
        comm_dtype: str = "fp32",
        adamw_betas: tuple[float, float] = (0.9, 0.95),
        adamw_eps: float = 1e-8,
        bucket_size_mb: float = 64.0,
        nonfinite_grads: str = "raise",
        row_blocks: Mapping[str, RowBlocks] | None = None,
        overlap: bool = False,
        momentum_dtype: str = "fp32",
    ):
        self.ns_dtype = _dtype(ns_dtype, "ns_dtype")
        self.comm_dtype = _dtype(comm_dtype, "comm_dtype")
        if nonfinite_grads not in NONFINITE_POLICIES:
            raise ValueError(f"titan_muon.Muon: nonfinite_grads={nonfinite_grads!r}; expected one of {NONFINITE_POLICIES}")
        if not bucket_size_mb > 0:
            raise ValueError(f"titan_muon.Muon: bucket_size_mb must be > 0, got {bucket_size_mb}")
        self.nonfinite_grads = nonfinite_grads
        self.row_blocks = dict(row_blocks or {})
        self.overlap = overlap
        self.storage = momentum_storage(momentum_dtype)
        self._overlap: BackwardOverlap | None = None
        self.bucket_bytes = int(bucket_size_mb * 2**20)
        defaults = dict(
            lr=lr,
            weight_decay=weight_decay,
            momentum=momentum,
            nesterov=nesterov,
            ns_steps=ns_steps,
            adjust_lr_fn=adjust_lr_fn,
            ns_coefficients=ns_coefficients,
            ns_eps=ns_eps,
            betas=adamw_betas,
            eps=adamw_eps,
            use_muon=True,
        )
        self._layout_ready = False
        super().__init__(params, defaults)
        self.skipped_steps = 0
        self._ns_seconds, self._ns_flops = 0.0, 0
        self.last_step_metrics: dict[str, float] = {}
        self._build_layout()

    # ------------------------------------------------------------------ setup

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        _validate_group(group, len(self.param_groups) - 1)
        if self._layout_ready:  # a group added after construction: plan again (collectively)
            self._build_layout()

    def _param_name(self, group_index: int, index: int) -> str:
        group = self.param_groups[group_index]
        if "param_names" in group:
            return group["param_names"][index]
        shape = tuple(group["params"][index].shape)
        return f"param_groups[{group_index}].params[{index}] (shape {shape})"

    def _build_layout(self) -> None:
        """Classify Muon params as sharded or local, build and cross-check the plan."""
        self._muon_params: list[_MuonParam] = []
        shard_mesh = None
        group_of_shards: dist.ProcessGroup | None = None
        group_ranks: list[int] | None = None
        for gi, group in enumerate(self.param_groups):
            for pi, p in enumerate(group["params"]):
                name = self._param_name(gi, pi)
                shard_group = _shard_group(p, name)
                if shard_group is not None:
                    ranks = dist.get_process_group_ranks(shard_group)
                    if group_ranks is None:
                        group_of_shards, group_ranks = shard_group, ranks
                        shard_mesh = p.device_mesh
                    elif ranks != group_ranks:
                        raise ValueError(
                            f"titan_muon.Muon: parameter {name!r} is sharded over ranks {ranks} but earlier "
                            f"parameters over {group_ranks}; one optimizer supports one sharding group"
                        )
                if not group["use_muon"]:
                    continue
                if p.ndim != 2:
                    raise ValueError(
                        f"titan_muon.Muon: parameter {name!r} has shape {tuple(p.shape)}; Muon groups take 2-D "
                        "matrices only. Put it in a group with use_muon=False (titan_muon.build_param_groups "
                        "does this for embeddings, the output head, norms and biases)."
                    )
                self._muon_params.append(_MuonParam(p, name, group, gi, sharded=shard_group is not None))

        self.transport = Transport(group_of_shards)
        world, rank = self.transport.world_size, self.transport.rank
        for entry in self._muon_params:
            if entry.sharded:
                local_rows = local_shard(entry.param).shape[0]
                start, end = shard_rows(entry.param.shape[0], world)[rank]
                if local_rows != end - start:
                    raise ValueError(
                        f"titan_muon.Muon: parameter {entry.name!r} holds {local_rows} local rows on rank {rank} "
                        f"but an even dim-0 split of {entry.param.shape[0]} rows over {world} ranks gives "
                        f"{end - start}; only torch.chunk-style Shard(0) (FSDP2's default) is supported"
                    )

        # Buckets follow reverse parameter order: the order in which backward finishes gradients.
        blocks = match_row_blocks([e.name for e in self._muon_params], self.row_blocks)
        units: list[Unit] = []
        self._unit_param: list[_MuonParam] = []
        self._local_units: list[tuple[_MuonParam, int, int]] = []  # (param, row_start, row_end)
        for index in reversed(range(len(self._muon_params))):
            entry = self._muon_params[index]
            rows, cols = entry.param.shape
            for start, end in row_block_ranges(rows, blocks.get(entry.name, rows), entry.name):
                if entry.sharded:
                    units.append(Unit(index, start, end, cols, rows))
                    self._unit_param.append(entry)
                else:
                    self._local_units.append((entry, start, end))
        self.plan: Plan = build_plan(units, world, self.bucket_bytes)
        self.transport.check_same_everywhere(self.plan.fingerprint(), "the Muon ownership plan")
        if self._overlap is not None:
            self._overlap.remove()
            self._overlap = None
        if self.overlap and units:
            self._overlap = BackwardOverlap(self, Transport(_twin_group(shard_mesh, group_ranks)))
        self._layout_ready = True

    def _ensure_state(self) -> None:
        """Create every parameter's state at once, identically on every rank (DCP needs equal keys)."""
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                if state:
                    continue
                if group["use_muon"]:
                    state.update(self.storage.create(p))
                else:
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)

    # ------------------------------------------------------------------- step

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        started = time.perf_counter()
        self.transport.bytes_sent = self.transport.bytes_received = 0
        self._ns_seconds, self._ns_flops = 0.0, 0
        self._ensure_state()
        verdict = self._agree_on_gradients()
        if verdict is None:  # non-finite gradients with nonfinite_grads="skip"
            self.skipped_steps += 1
            self.last_step_metrics = {"muon/skipped_steps": float(self.skipped_steps)}
            return loss
        no_grad_anywhere, arrived, grad_scale = verdict
        update_sq_sum, update_numel = self._muon_step(no_grad_anywhere, arrived, grad_scale)
        self._adamw_step()
        self.last_step_metrics = {
            "muon/update_rms": (update_sq_sum / max(update_numel, 1)) ** 0.5,
            "muon/step_time_ms": 1e3 * (time.perf_counter() - started),
            "muon/bytes_sent": float(self.transport.bytes_sent),
            "muon/bytes_received": float(self.transport.bytes_received),
            "muon/ns_time_ms": 1e3 * self._ns_seconds,
            "muon/ns_flops": float(self._ns_flops),
            "muon/skipped_steps": float(self.skipped_steps),
        }
        if self._overlap is not None:
            self.last_step_metrics["muon/bytes_sent_in_backward"] = float(self._overlap.transport.bytes_sent)
            self.last_step_metrics["muon/buckets_sent_in_backward"] = float(len(arrived))
            self._overlap.transport.bytes_sent = self._overlap.transport.bytes_received = 0
        return loss

    def _agree_on_gradients(self) -> tuple[set[Tensor], dict[int, Tensor], float] | None:
        """Decide collectively what to do about missing and non-finite gradients, and overlap.

        One all-reduce carries, per parameter, whether its gradient exists and is finite, and
        with overlap the sends made during backward and the sums that give the clipping factor.
        Returns (parameters with no gradient on any rank — skipped, as torch.optim does;
        buckets whose rows arrived during backward; their gradient scale), or None to skip the
        step. Raises the same error on every rank, before anything changes.
        """
        params = [(gi, pi, p) for gi, g in enumerate(self.param_groups) for pi, p in enumerate(g["params"])]
        grads = [None if p.grad is None else local_shard(p.grad) for _, _, p in params]
        present = [g is not None and g.numel() > 0 for g in grads]
        norms = torch._foreach_norm([g for g, ok in zip(grads, present) if ok], float("inf")) if any(present) else []
        finite = iter(torch.isfinite(torch.stack(norms)).tolist() if norms else [])
        flags = [float(g is not None) for g in grads] + [0.0 if not ok else float(not next(finite)) for ok in present]
        launches = self._overlap.launch_counts() if self._overlap else []
        sums = list(self._overlap.scale_sums()) if self._overlap else []
        status = torch.tensor(flags + launches + [c * c for c in launches] + sums, dtype=torch.float64)
        self.transport.all_reduce(status)
        n, world = len(params), self.transport.world_size
        has_grad, nonfinite = status[:n].tolist(), status[n : 2 * n].tolist()

        if launches:
            counts, squares = status[2 * n : 2 * n + len(launches)], status[2 * n + len(launches) : 2 * n + 2 * len(launches)]
            if not torch.equal(counts * counts, world * squares):
                self._overlap.remove()
                self._overlap, self.overlap = None, False
                raise RuntimeError(
                    "titan_muon.Muon: gradient hooks fired differently on different ranks during backward (this rank "
                    f"sent buckets {launches} times), so overlapped transfers cannot be matched. Overlap is now off; "
                    "this happens when ranks leave different parameters unused. Construct with overlap=False."
                )
        partial = [i for i, c in enumerate(has_grad) if 0 < c < world]
        bad = [self._param_name(gi, pi) for (gi, pi, _), c in zip(params, nonfinite) if c > 0]
        if self._overlap and (partial or bad):
            self._overlap.take()  # every rank sent the same buckets: drain them before leaving
        if partial:
            names = [self._param_name(*params[i][:2]) for i in partial]
            here = "present" if grads[partial[0]] is not None else "missing"
            raise RuntimeError(
                f"titan_muon.Muon: gradients of {names} exist on some ranks but not on others (the first is "
                f"{here} on this rank). Every rank must produce the same set of gradients; nothing was changed."
            )
        if bad:
            if self.nonfinite_grads == "skip":
                return None
            raise FloatingPointError(
                f"titan_muon.Muon: non-finite (NaN/Inf) gradients in {bad}; no parameter or state was changed. "
                'Pass nonfinite_grads="skip" to skip such steps instead.'
            )
        no_grad_anywhere = {p for (_, _, p), c in zip(params, has_grad) if c == 0}

        arrived, scale = {}, 1.0
        if self._overlap and any(launches):
            dot, norm = status[-2].item(), status[-1].item()
            scale = dot / norm if norm > 0 else 1.0
            agreed = torch.tensor([float(self._overlap.matches(scale))])
            self.transport.all_reduce(agreed, dist.ReduceOp.MIN)
            arrived = self._overlap.take()
            if not agreed.item():
                arrived = {}
        return no_grad_anywhere, arrived, scale

    def _muon_step(self, no_grad_anywhere: set[Tensor], arrived: dict[int, Tensor], grad_scale: float) -> tuple[float, int]:
        # Momentum on local shards; the matrices to orthogonalize, in local (row-shard) shape.
        to_orthogonalize: dict[int, Tensor] = {}
        for index, entry in enumerate(self._muon_params):
            group, p = entry.group, entry.param
            if p in no_grad_anywhere:
                to_orthogonalize[id(entry)] = torch.zeros(local_shard(p).shape, device=p.device)
                continue
            momentum = self.storage.load(self.state[p])
            to_orthogonalize[id(entry)] = momentum_step(local_shard(p.grad), momentum, group["momentum"], group["nesterov"])
            self.storage.store(self.state[p], momentum, stream=index)

        updates = self._orthogonalize_all(to_orthogonalize, arrived, grad_scale)

        sq_sum, numel = 0.0, 0
        for entry in self._muon_params:
            if entry.param in no_grad_anywhere:
                continue
            group, update = entry.group, updates[id(entry)]
            apply_update(local_shard(entry.param), update, group["lr"], group["weight_decay"])
            sq_sum += float(update.square().sum()) * group["lr"] ** 2
            numel += update.numel()
        return sq_sum, numel

    def _orthogonalize_all(
        self, local_matrices: dict[int, Tensor], arrived: dict[int, Tensor] | None = None, grad_scale: float = 1.0
    ) -> dict[int, Tensor]:
        """Scaled, orthogonalized updates in each parameter's local shape.

        `arrived` holds buckets whose raw gradient and previous momentum rows already reached
        their owners during backward (see overlap.py); their owners form the momentum update
        themselves, with the clipping factor `grad_scale` known only now.
        """
        rank = self.transport.rank
        arrived = arrived or {}
        results = {key: torch.empty_like(m) for key, m in local_matrices.items()}

        # Outbound: every remaining bucket leaves at once; owners work through them in order.
        in_flight: dict[int, Exchange] = {}
        for b in range(len(self.plan.buckets)):
            if b not in arrived:
                send = self._pack(b, [local_matrices])
                in_flight[b] = self.transport.all_to_all(send, self.plan.send_counts(b, rank), self.plan.recv_counts(b, rank))

        # Whole matrices that already sit on this rank: orthogonalize while shards travel.
        local_jobs = [(entry, local_matrices[id(entry)][r0:r1], r0, r1) for entry, r0, r1 in self._local_units]
        for (entry, _, r0, r1), out in zip(local_jobs, self._newton_schulz([(e, m) for e, m, *_ in local_jobs])):
            results[id(entry)][r0:r1] = out

        returning: list[tuple[int, Exchange]] = []
        for b in range(len(self.plan.buckets)):
            if b in arrived:
                owned = self._assemble(b, arrived[b], parts=2)
                matrices = []
                for u, (grad, momentum), slots in owned:
                    group = self._unit_param[u].group
                    update = momentum_step(grad.float().mul_(grad_scale), momentum.float(), group["momentum"], group["nesterov"])
                    matrices.append((u, update, slots))
            else:
                matrices = [(u, full.float(), slots) for u, (full,), slots in self._assemble(b, in_flight[b].wait(), parts=1)]
            outs = self._newton_schulz([(self._unit_param[u], m) for u, m, _ in matrices])
            back = torch.empty(sum(self.plan.recv_counts(b, rank)), dtype=self.comm_dtype)
            for (_, _, slots), out in zip(matrices, outs):
                row = 0
                for offset, n, rows in slots:
                    back[offset : offset + n].copy_(out[row : row + rows].reshape(-1))
                    row += rows
            returning.append((b, self.transport.all_to_all(back, self.plan.recv_counts(b, rank), self.plan.send_counts(b, rank))))

        for b, exchange in returning:
            received = exchange.wait()
            offset = 0
            for _, entry, lo, hi, n in self._outbound_pieces(b):
                rows = results[id(entry)][lo:hi]
                rows.copy_(received[offset : offset + n].view(rows.shape))
                offset += n
        return results

    def _outbound_pieces(self, bucket: int) -> list[tuple[int, _MuonParam, int, int, int]]:
        """(unit, param, local row start, local row end, numel) per unit of the bucket, ordered by owner."""
        rank, world = self.transport.rank, self.transport.world_size
        pieces = []
        for u in sorted(self.plan.buckets[bucket], key=lambda u: self.plan.owners[u]):
            unit = self.plan.units[u]
            lo, hi = unit.rows_in_shard(rank, world)
            pieces.append((u, self._unit_param[u], lo, hi, (hi - lo) * unit.cols))
        return pieces

    def _pack(self, bucket: int, sources: list[dict[int, Tensor]]) -> Tensor:
        """One send buffer: for each owner, this rank's rows of every source (e.g. gradient, then momentum)."""
        pieces = self._outbound_pieces(bucket)
        send = torch.empty(len(sources) * sum(p[-1] for p in pieces), dtype=self.comm_dtype)
        offset = 0
        for owner in range(self.transport.world_size):
            mine = [p for p in pieces if self.plan.owners[p[0]] == owner]
            for source in sources:
                for _, entry, lo, hi, n in mine:
                    send[offset : offset + n].copy_(source[id(entry)][lo:hi].reshape(-1))
                    offset += n
        return send

    def _assemble(self, bucket: int, received: Tensor, parts: int) -> list[tuple[int, list[Tensor], list]]:
        """Whole matrices of the units this rank owns, from a received outbound buffer.

        Per source rank the buffer holds `parts` consecutive blocks (see _pack), each with the
        owned units' rows in bucket order. Also returns, per unit, where each source's rows go in
        the (single-part) return buffer: (offset, numel, rows).
        """
        rank, world = self.transport.rank, self.transport.world_size
        counts = self.plan.recv_counts(bucket, rank)
        source_base = offsets([parts * c for c in counts])
        return_base = offsets(counts)
        filled = [0] * world
        owned = []
        for u in self.plan.owned_units(bucket, rank):
            unit = self.plan.units[u]
            blocks: list[list[Tensor]] = [[] for _ in range(parts)]
            slots = []
            for src in range(world):
                lo, hi = unit.rows_on(src, world)
                n = (hi - lo) * unit.cols
                for k in range(parts):
                    start = source_base[src] + k * counts[src] + filled[src]
                    blocks[k].append(received[start : start + n].view(hi - lo, unit.cols))
                slots.append((return_base[src] + filled[src], n, hi - lo))
                filled[src] += n
            owned.append((u, [torch.cat(b) for b in blocks], slots))
        return owned

    def _newton_schulz(self, jobs: list[tuple[_MuonParam, Tensor]]) -> list[Tensor]:
        """Orthogonalize and scale each matrix; equal shapes and settings run as one batch."""
        batches: dict[tuple, list[int]] = defaultdict(list)
        for i, (entry, m) in enumerate(jobs):
            g = entry.group
            batches[(tuple(m.shape), g["ns_steps"], str(g["ns_coefficients"]), g["ns_eps"], g["adjust_lr_fn"])].append(i)
        outs: list[Tensor | None] = [None] * len(jobs)
        for (shape, steps, _, eps, adjust_lr_fn), members in batches.items():
            method = jobs[members[0]][0].group["ns_coefficients"]
            stacked = torch.stack([jobs[i][1] for i in members])
            started = time.perf_counter()
            ortho = orthogonalize(stacked, steps, method, self.ns_dtype, eps)
            self._ns_seconds += time.perf_counter() - started
            self._ns_flops += len(members) * newton_schulz_flops(*shape, steps)
            ortho = ortho.float().mul_(update_scale(adjust_lr_fn, *shape))
            for k, i in enumerate(members):
                outs[i] = ortho[k]
        return outs

    def _adamw_step(self) -> None:
        for group in self.param_groups:
            if group["use_muon"]:
                continue
            params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                params.append(local_shard(p))
                grads.append(local_shard(p.grad))
                exp_avgs.append(local_shard(state["exp_avg"]))
                exp_avg_sqs.append(local_shard(state["exp_avg_sq"]))
                steps.append(state["step"])
            if not params:
                continue
            beta1, beta2 = group["betas"]
            adamw_functional(
                params, grads, exp_avgs, exp_avg_sqs, [], steps,
                amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"],
                weight_decay=group["weight_decay"], eps=group["eps"], maximize=False,
            )  # fmt: skip

    # ------------------------------------------------------------ checkpoints

    def load_state_dict(self, state_dict: dict) -> None:
        """Refuse state saved under another Muon/AdamW assignment, before changing anything."""
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(
                f"titan_muon.Muon: the checkpoint has {len(saved_groups)} param groups, this optimizer "
                f"{len(self.param_groups)}; the optimizer configuration changed since it was saved"
            )
        for gi, (saved, group) in enumerate(zip(saved_groups, self.param_groups)):
            if saved.get("use_muon", True) != group["use_muon"]:
                raise ValueError(
                    f"titan_muon.Muon: param group {gi} was saved with use_muon={saved.get('use_muon', True)} "
                    f"but is now use_muon={group['use_muon']}"
                )
            for index, pi in zip(saved["params"], range(len(group["params"]))):
                keys = set(state_dict["state"].get(index, {}))
                expected = set(self.storage.keys) if group["use_muon"] else {"step", "exp_avg", "exp_avg_sq"}
                if keys and keys != expected:
                    raise ValueError(
                        f"titan_muon.Muon: saved state of {self._param_name(gi, pi)!r} has keys {sorted(keys)}, "
                        f"expected {sorted(expected)} ({'Muon' if group['use_muon'] else 'AdamW'}); "
                        "was the checkpoint written with another optimizer or parameter split?"
                    )
        super().load_state_dict(state_dict)
        for entry in self._muon_params:
            entry.group = self.param_groups[entry.group_index]


def _twin_group(mesh, ranks: list[int]) -> dist.ProcessGroup:
    """A second process group over `ranks`, so overlapped sends never queue behind FSDP's collectives.

    ``new_group`` must be called by every process for every group, in the same order, so all
    groups along the sharded mesh dimension are created and this rank keeps its own.
    """
    if mesh.size() != dist.get_world_size():
        raise ValueError("titan_muon.Muon: overlap=True needs the FSDP mesh to span all processes")
    shard_dim = next(d for d in range(mesh.ndim) if dist.get_process_group_ranks(mesh.get_group(d)) == ranks)
    layout = mesh.mesh.movedim(shard_dim, -1).reshape(-1, mesh.size(shard_dim)).tolist()
    mine = None
    for group_ranks in layout:
        group = dist.new_group(group_ranks)
        if dist.get_rank() in group_ranks:
            mine = group
    return mine


def _shard_group(p: Tensor, name: str) -> dist.ProcessGroup | None:
    """The process group over which `p`'s rows are split, or None if this rank holds all of p."""
    if not isinstance(p, DTensor):
        return None
    placements = p.placements
    sharded = [d for d, pl in enumerate(placements) if not isinstance(pl, Replicate)]
    if not sharded:
        return None
    if len(sharded) > 1 or type(placements[sharded[0]]) is not Shard or placements[sharded[0]].dim != 0:
        raise ValueError(
            f"titan_muon.Muon: parameter {name!r} has DTensor placements {placements}; supported are "
            "Shard(0) on one mesh dimension (FSDP2) with Replicate on the others (HSDP)"
        )
    return p.device_mesh.get_group(sharded[0])


def _validate_group(group: dict, index: int) -> None:
    where = f"titan_muon.Muon: param group {index}"
    if not group["lr"] >= 0:
        raise ValueError(f"{where}: lr must be >= 0, got {group['lr']}")
    if not group["weight_decay"] >= 0:
        raise ValueError(f"{where}: weight_decay must be >= 0, got {group['weight_decay']}")
    if group["use_muon"]:
        if not 0 <= group["momentum"] < 1:
            raise ValueError(f"{where}: momentum must be in [0, 1), got {group['momentum']}")
        if not (isinstance(group["ns_steps"], int) and 1 <= group["ns_steps"] < 100):
            raise ValueError(f"{where}: ns_steps must be an integer in [1, 100), got {group['ns_steps']!r}")
        if group["adjust_lr_fn"] is not None and group["adjust_lr_fn"] not in ADJUST_LR_FNS:
            raise ValueError(f"{where}: adjust_lr_fn={group['adjust_lr_fn']!r}; expected None or one of {ADJUST_LR_FNS}")
        coefficients = group["ns_coefficients"]
        if isinstance(coefficients, str):
            if coefficients not in NS_METHODS:
                raise ValueError(f"{where}: ns_coefficients={coefficients!r}; expected one of {NS_METHODS} or (a, b, c)")
        else:
            coefficient_schedule(coefficients, 1)
    else:
        beta1, beta2 = group["betas"]
        if not (0 <= beta1 < 1 and 0 <= beta2 < 1):
            raise ValueError(f"{where}: betas must be in [0, 1), got {group['betas']}")
        if not group["eps"] > 0:
            raise ValueError(f"{where}: eps must be > 0, got {group['eps']}")
