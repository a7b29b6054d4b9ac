"""titan_muon.Muon: Muon for hidden matrices and AdamW for the rest, in one optimizer.

One step, top-down (``step``):
  1. agree on the gradients (one small all-reduce, one host read): a missing or non-finite
     gradient stops or skips the step on every rank alike, before anything changes;
  2. exchange (exchange.py): in owner-balanced rounds each rank sends its pieces of every
     matrix — Nesterov momentum, or with momentum on the owners the raw gradient — to the
     matrix's owner; each owner orthogonalizes its matrices once, batched by shape, and the
     scaled updates come back. Matrices a rank holds whole take the same path without
     collectives (a one-rank exchange);
  3. stage: everything the commit would allocate (new low-precision momentum) is computed;
  4. agree that every rank got through 2–3 (one tiny all-reduce, one host read); if a rank
     failed, every rank raises the same error and nothing has changed;
  5. commit, which allocates nothing: momentum, weight decay and the update on the local
     blocks; AdamW groups.

With ``demo=True`` (DeMo, demo_step.py) the optimizer also owns the replicate dimension: the
owners exchange compressed momentum with their counterparts in the other replicas in step 2,
AdamW gradients are averaged over the replicas, and both agreements span every replica.

Parameters are plain tensors (one process, or replicated) or DTensors whose placements give
every rank one block of each matrix (params.py, layout.py). The plan (owners, rounds, split
sizes) is a pure function of shapes and placements (plan.py), so a run on any layout
computes what the one-process run computes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from titan_muon import checkpoint, demo, settings
from titan_muon.commit import StepWork, adamw_step, commit, new_adamw_state, stage_momentum, staged_state
from titan_muon.demo_step import Replicas, check_groups, demo_settings
from titan_muon.exchange import ExchangeEngine, MemoryAccount, StepFailure, agree_on_success
from titan_muon.orthogonalizer import Orthogonalizer
from titan_muon.overlap import BackwardOverlap
from titan_muon.overlap import metrics as overlap_metrics
from titan_muon.metrics import momentum_bytes_per_element, state_bytes, step_metrics, wire_bytes
from titan_muon.params import MuonParam, build_units, locate
from titan_muon.plan import OVERLAP_MIN_ROUNDS, Piece, Unit, build_plan, rank_tables, send_counts_by_round
from titan_muon.redistribute import Batch, local_piece
from titan_muon.split import RowBlocks
from titan_muon.state import momentum_storage
from titan_muon.timing import StepTimer, phase
from titan_muon.transport import AcrossReplicas, Transport, build_route, choose_layout, lane_hierarchy, outbound_lane_group
from titan_muon.update import nesterov_input, nesterov_input_and_momentum
from titan_muon.verdict import Verdict, agree_on_gradients


class Muon(Optimizer):
    """Muon (momentum orthogonalized by Newton–Schulz) with AdamW groups, FSDP2-native.

    Param groups with ``use_muon=True`` (the default) hold 2-D matrices or 3-D stacks of
    matrices (MoE experts, one matrix per expert); groups with ``use_muon=False`` get AdamW
    with their own ``betas``, ``eps`` and ``weight_decay``. :func:`titan_muon.build_param_groups`
    splits a model the usual way.

    Args follow ``torch.optim.Muon`` (lr, weight_decay, momentum, nesterov, ns_steps,
    adjust_lr_fn), plus (README.md lists them all, docs/ explains them):
        ns_coefficients ("keller", "polar_express" or (a, b, c)), ns_algorithm ("auto",
            "standard", "gram"), ns_eps, ns_dtype ("auto": on CUDA bf16 for standard NS and fp16
            for Gram NS, fp32 elsewhere; "fp32", "bf16", "fp16");
        comm_dtype: "auto" (fp32 with fp32 NS, else bf16), "fp32" or "bf16": matrices and
            updates on the wire;
        adamw_betas, adamw_eps, adamw_implementation ("fused", "foreach", "for-loop");
        exchange_memory_mb: per-GPU MiB for the exchange buffers of the rounds in flight
            (8192); an owner always takes at least one matrix per round;
        rounds_in_flight (2); bucket_size_mb, buckets_in_flight: their deprecated names;
        nonfinite_grads: "raise" on every rank, or "skip" the step on every rank (then
            ``last_step_skipped`` is True until the next step, and QK-clip leaves it alone);
        row_blocks: Muon Split, FQN patterns -> row-block sizes (one block per head);
        momentum_dtype: "fp32", "bf16" or "fp8" (state.py);
        overlap: momentum on the owners, gradients sent during backward (overlap.py);
        pipeline_group: this rank's pipeline: a non-finite gradient in any stage raises or
            skips in every stage (TorchTitan's container passes it);
        demo: DeMo across replicas (docs/demo.md): each replica keeps its own momentum and the
            replicas exchange only its top ``demo_topk`` DCT coefficients per ``demo_chunk`` ×
            ``demo_chunk`` chunk, subtracting ``demo_alpha`` × what was sent; needs
            ``replicate_group`` (this rank and its counterparts in the other replicas, FSDP2
            applied on the shard mesh only), ``nesterov=False`` and fp32 momentum.
        hierarchical_exchange: "auto" (default), True or False: run each rank set's
            all-to-alls in two stages, within nodes and then across them along rails, so a rank
            has (ranks per node − 1) + (nodes − 1) peers instead of W − 1; "auto" does so for
            rank sets of more than 256 ranks on several nodes (docs/exchange.md, "W = 4096");
        ranks_per_node: ranks of one node, numbered consecutively (None: torchrun's
            LOCAL_WORLD_SIZE, else the visible GPU count on CUDA, else one node).
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
        ns_algorithm: str = "auto",
        ns_eps: float = 1e-7,
        ns_dtype: str = "auto",
        comm_dtype: str = "auto",
        adamw_betas: tuple[float, float] = (0.9, 0.95),
        adamw_eps: float = 1e-8,
        exchange_memory_mb: float | None = None,
        rounds_in_flight: int | None = None,
        bucket_size_mb: float | None = None,
        buckets_in_flight: int | None = None,
        nonfinite_grads: str = "raise",
        row_blocks: Mapping[str, RowBlocks] | None = None,
        overlap: bool = False,
        momentum_dtype: str = "fp32",
        adamw_implementation: str = "fused",
        pipeline_group=None,
        demo: bool = False,
        demo_chunk: int = demo.DEFAULT_CHUNK,
        demo_topk: int = demo.DEFAULT_TOPK,
        demo_alpha: float = demo.DEFAULT_ALPHA,
        replicate_group=None,
        hierarchical_exchange: bool | str = "auto",
        ranks_per_node: int | None = None,
    ):
        settings.check_options(ns_dtype, comm_dtype, nonfinite_grads, adamw_implementation)
        settings.check_hierarchy(hierarchical_exchange, ranks_per_node)
        self.demo = demo_settings(demo, demo_chunk, demo_topk, demo_alpha, replicate_group, momentum_dtype=momentum_dtype, overlap=overlap)
        self.replicate_group = replicate_group
        self.hierarchical_exchange, self.ranks_per_node = hierarchical_exchange, ranks_per_node
        self.exchange_memory_mb, self.rounds_in_flight = settings.exchange_memory(
            exchange_memory_mb, bucket_size_mb, rounds_in_flight, buckets_in_flight
        )
        self.ns_dtype_setting, self.comm_dtype_setting = ns_dtype, comm_dtype
        self.nonfinite_grads, self.row_blocks, self.overlap = nonfinite_grads, dict(row_blocks or {}), overlap
        self.adamw_implementation = adamw_implementation
        self.pipeline_group = pipeline_group
        self.storage = momentum_storage(momentum_dtype)
        self._overlaps: list[BackwardOverlap | None] = []
        defaults = dict(
            lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps,
            adjust_lr_fn=adjust_lr_fn, ns_coefficients=ns_coefficients, ns_algorithm=ns_algorithm, ns_eps=ns_eps,
            betas=adamw_betas, eps=adamw_eps, use_muon=True, matrix_stacks=False,
        )  # fmt: skip
        self._layout_ready = False
        super().__init__(params, defaults)
        self.skipped_steps = 0
        self.last_step_skipped = False
        self.owner_blocks: dict[tuple[int, int], dict] = {}  # (rank set, unit) -> whole-matrix state
        self._metrics: dict[str, float | Tensor] = {}
        self._metrics_read: dict[str, float] | None = None
        self._build_layout()

    # ------------------------------------------------------------------ setup

    def add_param_group(self, param_group: dict) -> None:
        given = dict(param_group)
        super().add_param_group(param_group)
        settings.validate_group(self.param_groups[-1], len(self.param_groups) - 1, given, self.defaults["eps"])
        if self._layout_ready:  # a group added after construction: plan again (collectively)
            self._build_layout()

    def set_pipeline_group(self, pipeline_group) -> None:
        """Join this rank's pipeline after construction (the ``pipeline_group`` argument, given
        later): from the next step on, a non-finite gradient in any stage raises or skips in
        every stage. For containers that learn the pipeline only once the optimizer is built
        (torchtitan 0.3.0). No collective."""
        self.pipeline_group = pipeline_group
        self.pipeline = Transport(pipeline_group, self.device) if pipeline_group is not None else None

    def param_name(self, group_index: int, index: int) -> str:
        group = self.param_groups[group_index]
        if "param_names" in group:
            return group["param_names"][index]
        return f"param_groups[{group_index}].params[{index}] (shape {tuple(group['params'][index].shape)})"

    def _build_layout(self) -> None:
        """Find where every Muon matrix lives, then plan each rank set's rounds and this rank's tables."""
        self.device = settings.common_device([p for g in self.param_groups for p in g["params"]])
        self.ns_precision = settings.resolve_ns_precision(self.ns_dtype_setting, self.device)
        self.ns_dtype = self.ns_precision.standard  # standard NS's dtype; Orthogonalizer.plan gives each shape's
        comm = self.comm_dtype_setting
        self.comm_dtype = settings.auto_comm_dtype(self.ns_precision) if comm == "auto" else settings.resolve_dtype(comm, "comm_dtype", self.device)
        self.newton_schulz = Orthogonalizer(lambda: self.param_groups, self.ns_precision, self.device)
        if self.demo is not None:
            check_groups(self.param_groups)
        self.muon_params: list[MuonParam] = []
        self._names = [self.param_name(gi, pi) for gi, g in enumerate(self.param_groups) for pi in range(len(g["params"]))]
        for gi, group in enumerate(self.param_groups):
            for pi, p in enumerate(group["params"]):
                if group["use_muon"]:
                    settings.check_muon_param(p, self.param_name(gi, pi), group)
                    self.muon_params.append(MuonParam(p, self.param_name(gi, pi), group, gi, len(self.muon_params), None))
                elif not p.dtype.is_floating_point:
                    raise ValueError(f"titan_muon.Muon: parameter {self.param_name(gi, pi)!r} has dtype {p.dtype}; floating-point parameters only")
        rank_sets, covering = locate(self.muon_params)
        self.transport = Transport(covering, self.device)  # the step's two agreements
        self.pipeline = Transport(self.pipeline_group, self.device) if self.pipeline_group is not None else None
        units, shardings = build_units(self.muon_params, self.row_blocks)
        round_bytes = self.exchange_memory_mb * 2**20 / self.rounds_in_flight
        owner_bytes = settings.owner_bytes_per_element(self.comm_dtype, self.ns_precision)
        for overlap in self._overlaps:
            if overlap is not None:
                overlap.remove()
        self.engines: list[ExchangeEngine] = []
        for index, rank_set in enumerate(rank_sets):
            plan = build_plan(units[index], shardings, dist.get_world_size(rank_set.group), round_bytes, self._unit_flops,
                              owner_bytes, min_rounds=OVERLAP_MIN_ROUNDS if self.overlap else 1)  # fmt: skip
            self.engines.append(self._engine(rank_set.group, plan, shardings))
        self.sharded_engines = list(self.engines)
        if None in units:  # matrices this rank holds whole: a one-rank exchange, no collectives
            alone = Transport(None, self.device)
            plan = build_plan(units[None], shardings, 1, round_bytes, self._unit_flops, owner_bytes)
            self.engines.append(ExchangeEngine(plan, rank_tables(plan, shardings, 0), alone, alone, self.rounds_in_flight))
        self.owner_momentum = (self.overlap and bool(self.sharded_engines)) or self.demo is not None
        self._overlaps = [BackwardOverlap(self.muon_params, e) if self.overlap and self._owners_hold(e) else None for e in self.engines]
        self.replicas = None
        if self.demo is not None:  # after the plans: every replica must have made the same ones
            self.replicas = Replicas(self.demo, self.replicate_group, self.device)
            self.transport = AcrossReplicas(self.transport, self.replicas.transport)
            params = [p for g in self.param_groups for p in g["params"]]
            self.replicas.check_consistent(params, self._names, hash(tuple(e.plan.fingerprint() for e in self.engines)))
        self._layout_ready = True

    def _engine(self, group, plan, shardings) -> ExchangeEngine:
        """The exchange engine of one rank set: flat lanes, or hierarchical ones (a node and a rail
        communicator per lane, tables in their buffer orders, each round's route built from the
        node-mates' send counts, which the plan gives without any exchange)."""
        ranks_per_node = settings.ranks_per_node(self.ranks_per_node, self.device)
        layout = choose_layout(self.hierarchical_exchange, dist.get_process_group_ranks(group), ranks_per_node)
        flat = Transport(group, self.device)
        digest = hashlib.sha256(repr((plan.fingerprint(), layout)).encode()).digest()
        flat.check_same_everywhere(int.from_bytes(digest[:8], "little") >> 1, "the Muon ownership plan")  # layout included
        if layout is None:
            tables = rank_tables(plan, shardings, flat.rank)
            return ExchangeEngine(plan, tables, Transport(outbound_lane_group(group), self.device), flat, self.rounds_in_flight)
        tables = rank_tables(plan, shardings, flat.rank, layout.local_major(), layout.node_major())
        node, local = layout.place(flat.rank)
        mates = [send_counts_by_round(plan, shardings, mate) if mate != flat.rank else [t.send_counts for t in tables]
                 for mate in layout.members[node]]  # fmt: skip
        routes = tuple(build_route(layout, flat.rank, t.send_counts, t.recv_counts, [m[r] for m in mates], self.device)
                       for r, t in enumerate(tables))  # fmt: skip
        outbound = Transport(group, self.device, lane_hierarchy(group, layout, "outbound"))
        back = Transport(group, self.device, lane_hierarchy(group, layout, "return"))
        return ExchangeEngine(plan, tables, outbound, back, self.rounds_in_flight, routes)

    def _ensure_state(self) -> None:
        """Create every parameter's state at once, identically on every rank (DCP needs equal keys)."""
        for group in self.param_groups:
            if not group["use_muon"]:
                for p in group["params"]:
                    if not self.state[p]:
                        self.state[p].update(new_adamw_state(p, self.adamw_implementation))
        for entry in self.muon_params:
            state = self.state[entry.param]
            if self._on_owner(entry):  # momentum on the owners
                for key, value in self.storage.placeholders(self.device).items():
                    state.setdefault(key, value)
            elif not state:
                state.update(self.storage.create(entry.param))
        for s, engine in enumerate(self.engines):
            if not self._owners_hold(engine):
                continue
            for u in engine.owned_units():
                if (s, u) not in self.owner_blocks:
                    unit = engine.units[u]
                    self.owner_blocks[(s, u)] = self.storage.create_block(unit.rows, unit.cols, self.device)

    # ------------------------------------------------------------------- step

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        settings.check_step(self.param_groups, self.param_name)
        timer = StepTimer(self.device)
        timer.start("step")
        self._ensure_state()
        self._align_gradients()
        params = [p for g in self.param_groups for p in g["params"]]
        with phase("check_gradients"):
            verdict = agree_on_gradients(params, lambda i: self._names[i], self.transport, self._overlaps, self.nonfinite_grads, self.pipeline)
        self.last_step_skipped = verdict.skip_step
        if verdict.skip_step:
            self.skipped_steps += 1
            # what overlap sent during this step's backward is this step's, not the next one's
            self._set_metrics({**wire_bytes(self.engines), "muon/skipped_steps": float(self.skipped_steps)})
            return loss
        failure, work = StepFailure(), StepWork()
        if self.replicas is not None:
            self.replicas.begin_step()
            with phase("demo_adamw_average"):
                self.replicas.average_adamw_gradients(self.param_groups)
        self._exchange(verdict, failure, timer, work)
        with phase("stage_commit"):
            self._stage_commit(verdict, failure, work)
        with phase("agree_on_success"):
            agree_on_success(self.transport, failure)
        with phase("commit"):
            self._commit(verdict, work)
        with phase("adamw"):
            adamw_step(self.param_groups, self.state, self.adamw_implementation)
        timer.stop("step")
        momentum = [self.state[e.param] for e in self.muon_params] + list(self.owner_blocks.values())
        per_element = momentum_bytes_per_element(momentum, self.storage.tensor_keys[0])
        demo_metrics = self.replicas.metrics() if self.replicas is not None else {}
        self._set_metrics({**step_metrics(work, timer, self.engines, self.skipped_steps), **overlap_metrics(verdict.early),
                           "muon/momentum_bytes_per_element": per_element, **demo_metrics})  # fmt: skip
        return loss

    def _align_gradients(self) -> None:
        """Give every DTensor gradient its parameter's placements (plain DTensor autograd under
        tensor parallel can leave one Partial); collectives on the device, no host reads."""
        for group in self.param_groups:
            for p in group["params"]:
                if isinstance(p.grad, DTensor) and isinstance(p, DTensor) and tuple(p.grad.placements) != tuple(p.placements):
                    p.grad = p.grad.redistribute(p.device_mesh, p.placements)

    def _owners_hold(self, engine: ExchangeEngine) -> bool:
        """Whether `engine`'s owners hold its matrices' momentum (overlap; DeMo: every engine,
        the one-rank one included), so raw gradients travel."""
        return self.demo is not None or (self.owner_momentum and engine in self.sharded_engines)

    def _on_owner(self, entry: MuonParam) -> bool:
        """Whether a parameter's momentum lives on its matrices' owners."""
        return self.demo is not None or (self.owner_momentum and entry.sharding is not None)

    def _exchange(self, verdict: Verdict, failure: StepFailure, timer: StepTimer, work: StepWork) -> None:
        """Every rank set's rounds; last, the matrices this rank holds whole (a one-rank exchange)."""
        momenta: dict[int, Tensor] = {}  # decoded once per parameter and step
        for s, engine in enumerate(self.engines):
            early = verdict.early[s]
            scales = early.scales if early is not None else {}

            def fill(piece: Piece, slot: Tensor, engine=engine) -> None:
                self._matrix_to_send(self.muon_params[engine.units[piece.unit].param], piece, verdict, momenta, slot, work.memory)

            def receive(r: int, piece: Piece, update: Tensor, engine=engine) -> None:
                entry = self.muon_params[engine.units[piece.unit].param]
                if id(entry.param) not in verdict.skipped:
                    work.updates.append((entry, local_piece(entry.stack(entry.param), piece), update))

            work.held += engine.run(
                dtype=torch.float32 if self._owners_hold(engine) else self.comm_dtype, return_dtype=self.comm_dtype,
                fill=fill, receive=receive, failure=failure, memory=work.memory,
                orthogonalize=lambda r, batches, s=s, scales=scales: self._orthogonalize_owned(s, r, batches, scales, verdict, timer, work),
                key_of=lambda u, engine=engine: self._ns_key(engine.units[u]),
                arrived=early.arrived if early is not None else None,
                settle=(lambda r, s=s, engine=engine: self.replicas.settle(s, r, engine)) if self.replicas is not None else None,
            )  # fmt: skip

    def _matrix_to_send(self, entry: MuonParam, piece: Piece, verdict: Verdict, momenta: dict[int, Tensor], out: Tensor,
                        memory: MemoryAccount) -> None:  # fmt: skip
        """A piece as it travels: the Nesterov input g + μ(M' − g) from this rank's momentum, or
        the raw gradient when momentum lives on the owners; zeros for a parameter without gradients."""
        p = entry.param
        if id(p) in verdict.skipped:
            out.zero_()
        elif self._on_owner(entry):
            out.copy_(local_piece(entry.stack(p.grad), piece))
        else:
            if entry.index not in momenta:
                momenta[entry.index] = entry.stack(self.storage.load(self.state[p]))
                if self.storage.name != "fp32":  # a decoded copy, held for the rest of the exchange
                    memory.add(momenta[entry.index].numel() * 4)
            grad = local_piece(entry.stack(p.grad), piece).float()
            momentum = local_piece(momenta[entry.index], piece)
            if out.dtype == torch.float32:
                nesterov_input(grad, momentum, entry.group["momentum"], entry.group["nesterov"], out=out)
            else:
                out.copy_(nesterov_input(grad, momentum, entry.group["momentum"], entry.group["nesterov"]))

    def _orthogonalize_owned(self, s: int, r: int, batches: list[Batch], scales: dict, verdict: Verdict, timer: StepTimer,
                             work: StepWork) -> dict[int, Tensor]:  # fmt: skip
        results: dict[int, Tensor] = {}
        for batch, matrices in zip(batches, self._owner_inputs(s, r, batches, scales, verdict, work)):
            workspace = self.newton_schulz.workspace_bytes(batch.key, matrices)
            work.memory.add(workspace)
            out = self.newton_schulz(batch.key, matrices, timer, work)
            work.memory.free(workspace)
            work.memory.add(out.numel() * out.element_size())  # until the return buffer is packed (engine frees it)
            results.update(zip(batch.units, out.unbind(0)))
        return results

    def _owner_inputs(self, s: int, r: int, batches: list[Batch], scales: dict, verdict: Verdict, work: StepWork) -> list[Tensor]:
        """What Newton–Schulz gets for each batch: DeMo's average of the replicas' compressed
        momentum, the owners' Nesterov input, or (momentum on the shards) the matrices as they arrived."""
        engine = self.engines[s]
        if self.replicas is not None:
            with phase("demo"):
                return self.replicas.round_inputs(s, r, engine, batches, self.owner_blocks, self.muon_params, verdict.skipped,
                                                  self.storage, work)  # fmt: skip
        if self._owners_hold(engine):
            with phase("owner_momentum"):
                return [self._owner_nesterov(s, b.units, b.matrices, scales.get(r, {}), verdict, work) for b in batches]
        return [b.matrices for b in batches]

    def _owner_nesterov(self, s: int, units: list[int], gradients: Tensor, scales: dict[int, float], verdict: Verdict,
                        work: StepWork) -> Tensor:  # fmt: skip
        """With momentum on the owners: M' = μM + (1−μ)·c·g on whole matrices (staged for the
        commit) and the Nesterov input, rounded to the wire dtype as the shard-side path sends
        it. c undoes what happened to the gradient after it was sent during backward (gradient
        clipping), 1 if sent in step(). A matrix without gradients keeps its momentum."""
        engine = self.engines[s]
        out = torch.empty_like(gradients)
        for u, grad, slot in zip(units, gradients.unbind(0), out.unbind(0)):
            unit = engine.units[u]
            entry = self.muon_params[unit.param]
            if id(entry.param) in verdict.skipped:
                slot.zero_()
                continue
            c = scales.get(unit.param, 1.0)
            if c != 1.0:
                grad.mul_(c)  # `gradients` is this batch's own assembled copy
            state = self.owner_blocks[(s, u)]
            new = nesterov_input_and_momentum(grad, self.storage.load(state), entry.group["momentum"], entry.group["nesterov"], out=slot)
            first_row = unit.matrix * entry.param.shape[-2] + unit.row_start
            work.staged.append((state, staged_state(self.storage, state, new, unit.param, first_row, work.memory)))
        return out.to(self.comm_dtype).float() if self.comm_dtype != torch.float32 else out

    def _ns_key(self, unit: Unit) -> tuple[tuple[int, int], int]:
        """Matrices batch together when they have one shape and one param group's settings."""
        return (unit.shape, self.muon_params[unit.param].group_index)

    def _unit_flops(self, unit: Unit) -> int:
        return self.newton_schulz.flops(self.muon_params[unit.param].group, unit.rows, unit.cols)

    def _sharded_momentum(self, verdict: Verdict) -> list[MuonParam]:
        """Parameters with a gradient whose momentum this rank holds as its own block."""
        return [e for e in self.muon_params if id(e.param) not in verdict.skipped and not self._on_owner(e)]

    def _stage_commit(self, verdict: Verdict, failure: StepFailure, work: StepWork) -> None:
        if failure.error is not None:
            return
        try:
            stage_momentum(self.storage, self._sharded_momentum(verdict), self.state, work)
        except Exception as error:  # noqa: BLE001 - settled on every rank in agree_on_success
            failure.record(error, "staging the new momentum")

    def _commit(self, verdict: Verdict, work: StepWork) -> None:
        commit(self.storage, self._sharded_momentum(verdict), self.state, self.param_groups, work)
        if self.owner_momentum:
            for entry in self.muon_params:
                if self._on_owner(entry) and id(entry.param) not in verdict.skipped and "step" in self.state[entry.param]:
                    self.state[entry.param]["step"] += 1  # its blocks count their stores the same way

    # ---------------------------------------------------------------- metrics

    def _set_metrics(self, metrics: dict[str, float | Tensor]) -> None:
        self._metrics, self._metrics_read = metrics, None

    @property
    def last_step_metrics(self) -> dict[str, float]:
        """This rank's figures for the last step. Reading them is the only host sync they cost
        (device timings and sums stay on the device until then)."""
        if self._metrics_read is None:
            self._metrics_read = {k: float(v) if not callable(v) else float(v()) for k, v in self._metrics.items()}
        return self._metrics_read

    def local_state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds: AdamW moments, Muon momentum on its blocks
        or, with momentum on the owners, the whole matrices it owns."""
        return state_bytes([*self.state.values(), *self.owner_blocks.values()])

    # ------------------------------------------------------------ checkpoints

    hierarchical_exchange: bool | str = "auto"  # for copies of optimizers pickled before the option existed
    ranks_per_node: int | None = None
    _CARRIED = ("exchange_memory_mb", "rounds_in_flight", "ns_dtype_setting", "comm_dtype_setting", "nonfinite_grads",
                "row_blocks", "overlap", "adamw_implementation", "storage", "skipped_steps", "owner_blocks", "pipeline_group",
                "demo", "replicate_group", "hierarchical_exchange", "ranks_per_node")  # fmt: skip

    def __getstate__(self) -> dict:
        return {**super().__getstate__(), **{key: self.__dict__[key] for key in self._CARRIED}}

    def __setstate__(self, state: dict) -> None:
        """A copy (``copy.deepcopy``) plans its layout again: a collective, like construction."""
        super().__setstate__(state)
        self._overlaps, self._metrics, self._metrics_read = [], {}, None
        self._build_layout()

    def state_dict(self) -> dict:
        """With momentum on the owners, their blocks travel back into state tensors laid out
        like the parameters first (a collective: call it on every rank, as DCP does)."""
        return checkpoint.state_dict(self, super().state_dict())

    def load_state_dict(self, state_dict: dict) -> None:
        """Refuse state saved under another Muon/AdamW assignment, before changing anything."""
        checkpoint.load_state_dict(self, state_dict, super().load_state_dict)
