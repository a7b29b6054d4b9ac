"""titan_muon.Muon: Muon for hidden matrices and AdamW for the rest, in one optimizer.

One step, top-down (``step``):
  1. reserve: a streaming step's buffers are all cut from memory reserved now (exchange/reservation.py);
  2. agree on the gradients and the reservation (one small all-reduce, one host read): a missing or non-finite
     gradient, or a rank that could not reserve, stops or skips the step on every rank, before anything changes;
  3. exchange (exchange/engine.py): in owner-balanced rounds each rank sends its pieces of every
     matrix (Nesterov momentum; with momentum on the owners, the raw gradient) to its owner, which
     orthogonalizes it once, batched by shape; the scaled updates come back, and a streaming step
     writes each round as it returns. Matrices held whole take the same path without collectives;
  4. stage what the commit would allocate (new low-precision momentum); agree that every rank got
     through (one tiny all-reduce, one host read), else every rank raises the same error;
  5. commit, which allocates nothing: momentum, weight decay and the update on the local blocks; AdamW.

With ``demo=True`` (DeMo, demo/step.py) the owners also exchange compressed momentum across the
replicas, AdamW gradients are averaged over them, and both agreements span every replica. The plan
(owners, rounds, split sizes) is a pure function of shapes and placements (plan.py), so a run on
any layout computes what the one-process run computes.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor
from torch.optim import Optimizer

from titan_muon import settings
from titan_muon.step.commit import StepWork, adamw_step, commit, refuse_after_partial_step, stage_momentum
from titan_muon.step.matrix_step import MatrixStep, reserve_rounds
from titan_muon.algorithm.orthogonalizer import Orthogonalizer
from titan_muon.algorithm.update import Elementwise
from titan_muon.attention.split import RowBlocks
from titan_muon.demo import dct as demo
from titan_muon.demo import low_rank, sign
from titan_muon.demo.step import Replicas, check_groups, demo_settings, demo_storage
from titan_muon.exchange.engine import EngineSettings, ExchangeEngine, StepFailure, agree_on_success, build_engines
from titan_muon.exchange.overlap import BackwardOverlap
from titan_muon.exchange.params import MuonParam, build_units, collect_muon_params, locate
from titan_muon.exchange.plan import OVERLAP_MIN_ROUNDS, Unit
from titan_muon.exchange.reservation import ReservationStore
from titan_muon.exchange.transport import AcrossReplicas, Transport
from titan_muon.step.agreement import Verdict, agree_on_gradients, align_gradient_placements, decided_for_several_parts
from titan_muon.metrics import state_bytes, step_metrics, wire_bytes
from titan_muon import checkpoint
from titan_muon.state.momentum import momentum_storage
from titan_muon.timing import StepTimer, phase


class Muon(Optimizer):
    """Muon (momentum orthogonalized by Newton–Schulz) with AdamW groups, FSDP2-native.

    Per matrix W with gradient G, as titan_muon/muon_math.py states it on one page::

        M ← μ·M + (1 − μ)·G;  X = (1 − μ)·G + μ·M with Nesterov, else M
        O = NewtonSchulz(X) ≈ U·Vᵀ of X = U·S·Vᵀ;  W ← (1 − lr·wd)·W − lr·scale(rows, cols)·O

    Every rank gives each matrix one owner: the shards travel to it, it orthogonalizes the
    whole matrix, the update travels back (docs/design.md). The result equals that page.

    Param groups with ``use_muon=True`` (the default) hold 2-D matrices or 3-D stacks of
    matrices (MoE experts, one matrix per expert); groups with ``use_muon=False`` get AdamW
    with their own ``betas``, ``eps`` and ``weight_decay``. :func:`titan_muon.build_param_groups`
    splits a model the usual way.

    Positional args are ``torch.optim.Muon``'s, in its order and meanings (``eps``: Newton–Schulz's
    epsilon, also ``ns_eps``; in an AdamW group ``eps`` is AdamW's, default ``adamw_eps``). Further
    (docs/reference.md lists them all, docs/ explains them):
        ns_algorithm ("auto", "standard", "gram"), ns_dtype ("auto": on CUDA bf16 for standard
            NS and fp16 for Gram NS, fp32 elsewhere); comm_dtype ("auto", "fp32", "bf16"): the wire;
        adamw_betas, adamw_eps, adamw_implementation ("fused", "foreach", "for-loop");
        exchange_memory_mb: per-GPU MiB for the exchange buffers of the rounds in flight
            (2048); an owner always takes at least one matrix per round;
        commit: "auto" ("streaming" where the step's memory can be reserved up front: fp32 momentum
            on the shards, one model part per rank; else "atomic"), "atomic" (nothing written until every
            rank succeeded) or "streaming" (each round's weights written as it returns; commit.py);
        rounds_in_flight (2); bucket_size_mb, buckets_in_flight: their deprecated names;
        nonfinite_grads: "raise" or "skip" the step, on every rank (``last_step_skipped``);
        row_blocks: Muon Split, FQN patterns -> row-block sizes (one block per head);
        momentum_dtype: "fp32", "bf16" or "fp8" (state.py);
        overlap: momentum on the owners, gradients sent during backward (overlap.py);
        pipeline_group: a non-finite gradient in any stage raises or skips in every stage;
        demo, demo_compressor ("dct", "low_rank"), demo_chunk, demo_topk, demo_rank, demo_alpha, demo_shared_momentum,
            demo_adamw ("sign", "dense": the AdamW gradients), replicate_group: DeMo across replicas (demo/);
        hierarchical_exchange ("auto", True, False), ranks_per_node: two-stage all-to-alls,
            within nodes and along rails (docs/exchange.md, "W = 4096");
        compile_elementwise: the element-wise passes as ``torch.compile``d kernels (update.py), and
        keep_reservation: a streaming step's reserved memory kept between steps (reservation.py);
            None (default): compiled on CUDA only, kept off it (no caching allocator keeps it there).
    ``measure_update_rms = False`` before a step skips ``muon/update_rms`` (eagerly one read of every update; compiled, a sum in the commit's pass), as the torchtitan adapter does between logged steps.
    """

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: str | tuple[float, float, float] = "keller",
        eps: float | None = None,
        ns_steps: int = 5,
        adjust_lr_fn: str | None = None,
        *,
        ns_algorithm: str = "auto",
        ns_eps: float | None = None,
        ns_dtype: str = "auto",
        comm_dtype: str = "auto",
        adamw_betas: tuple[float, float] = (0.9, 0.95),
        adamw_eps: float = 1e-8,
        exchange_memory_mb: float | None = None,
        rounds_in_flight: int | None = None,
        bucket_size_mb: float | None = None,
        buckets_in_flight: int | None = None,
        nonfinite_grads: str = "raise",
        commit: str = "auto",
        row_blocks: Mapping[str, RowBlocks] | None = None,
        overlap: bool = False,
        momentum_dtype: str = "fp32",
        adamw_implementation: str = "fused",
        pipeline_group=None,
        demo: bool = False,
        demo_chunk: int = demo.DEFAULT_CHUNK,
        demo_topk: int = demo.DEFAULT_TOPK,
        demo_alpha: float = demo.DEFAULT_ALPHA,
        demo_shared_momentum: bool = demo.DEFAULT_SHARED_MOMENTUM,
        demo_compressor: str = low_rank.DEFAULT_COMPRESSOR,
        demo_rank: int = low_rank.DEFAULT_RANK,
        demo_adamw: str = sign.DEFAULT_ADAMW,
        replicate_group=None,
        hierarchical_exchange: bool | str = "auto",
        ranks_per_node: int | None = None,
        compile_elementwise: bool | None = None,
        keep_reservation: bool | None = None,
    ):
        ns_eps = settings.newton_schulz_eps(eps, ns_eps)
        settings.check_options(ns_dtype, comm_dtype, nonfinite_grads, adamw_implementation, commit)
        settings.check_hierarchy(hierarchical_exchange, ranks_per_node)
        self.demo = demo_settings(demo, demo_chunk, demo_topk, demo_alpha, replicate_group, momentum_dtype=momentum_dtype, overlap=overlap,
                                  shared_momentum=demo_shared_momentum, compressor=demo_compressor, rank=demo_rank, adamw=demo_adamw)  # fmt: skip
        self.replicate_group = replicate_group
        self.hierarchical_exchange, self.ranks_per_node = hierarchical_exchange, ranks_per_node
        self.compile_elementwise, self.keep_reservation = compile_elementwise, settings.optional_flag(keep_reservation, "keep_reservation")
        self.exchange_memory_mb, self.rounds_in_flight = settings.exchange_memory(exchange_memory_mb, bucket_size_mb, rounds_in_flight, buckets_in_flight)
        self.ns_dtype_setting, self.comm_dtype_setting = ns_dtype, comm_dtype
        self.nonfinite_grads, self.row_blocks, self.overlap, self.commit_mode = nonfinite_grads, dict(row_blocks or {}), overlap, commit
        self.adamw_implementation = adamw_implementation
        self.pipeline_group = pipeline_group
        self.storage = momentum_storage(momentum_dtype) if self.demo is None else demo_storage(self.demo)
        self._overlaps: list[BackwardOverlap | None] = []
        defaults = dict(
            lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps,
            adjust_lr_fn=adjust_lr_fn, ns_coefficients=ns_coefficients, ns_algorithm=ns_algorithm, ns_eps=ns_eps,
            betas=adamw_betas, eps=adamw_eps, use_muon=True, matrix_stacks=False,
        )  # fmt: skip
        self._layout_ready = False
        super().__init__(params, defaults)
        self.skipped_steps, self.last_step_skipped, self.measure_update_rms = 0, False, True
        self.owner_blocks: dict[tuple[int, int], dict] = {}  # (rank set, unit) -> whole-matrix state
        self._metrics, self._metrics_read = {}, None  # this step's figures (some on the device), and as read
        self._build_layout()

    # ------------------------------------------------------------------ setup

    def add_param_group(self, param_group: dict) -> None:
        """torch's add_param_group, then this group's checks; a refused group is taken out again
        (a group added after construction plans the layout again, collectively)."""
        given = dict(param_group)
        super().add_param_group(param_group)
        try:
            settings.check_added_group(self.param_groups, given, self.defaults["eps"], self.param_name if self._layout_ready else None)
        except Exception:
            self.param_groups.pop()
            raise
        if self._layout_ready:  # plan again (collectively); owner blocks are keyed by the plan's units
            owner_momentum = checkpoint.owner_momentum_like_params(self)
            try:
                self._build_layout()
            except Exception:
                self.param_groups.pop()
                self._build_layout()  # the layout without it, as before the call
                raise
            checkpoint.momentum_back_to_owners(self, owner_momentum)

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
        self.elementwise = Elementwise(settings.compile_elementwise(self.compile_elementwise, self.device), self.device.type)
        self.reservations = ReservationStore(self.device, settings.keeps_reservation(self.keep_reservation, self.device))
        if self.demo is not None:
            check_groups(self.param_groups, self.demo)
        self._names = [self.param_name(gi, pi) for gi, g in enumerate(self.param_groups) for pi in range(len(g["params"]))]
        self.muon_params: list[MuonParam] = collect_muon_params(self.param_groups, self.param_name)
        others = [(self.param_name(gi, pi), p) for gi, g in enumerate(self.param_groups) if not g["use_muon"] for pi, p in enumerate(g["params"])]
        rank_sets, covering = locate(self.muon_params, others)
        self.transport = Transport(covering, self.device)  # the step's two agreements
        self.pipeline = Transport(self.pipeline_group, self.device) if self.pipeline_group is not None else None
        units, shardings = build_units(self.muon_params, self.row_blocks)
        for overlap in self._overlaps:
            if overlap is not None:
                overlap.remove()
        owner_momentum = "all" if self.demo is not None else "sharded" if self.overlap else None
        self.engines: list[ExchangeEngine] = build_engines(units, shardings, [rank_set.group for rank_set in rank_sets], self._unit_flops, EngineSettings(
            device=self.device, round_bytes=self.exchange_memory_mb * 2**20 / self.rounds_in_flight,
            owner_bytes=settings.owner_bytes_per_element(self.comm_dtype, self.ns_precision), rounds_in_flight=self.rounds_in_flight,
            min_rounds=OVERLAP_MIN_ROUNDS if self.overlap else 1, hierarchical_exchange=self.hierarchical_exchange,
            ranks_per_node=settings.ranks_per_node(self.ranks_per_node, self.device), owner_momentum=owner_momentum,
        ))  # fmt: skip
        for entry in self.muon_params:
            entry.momentum_on_owner = self.engine_of(entry).owners_hold_momentum
        self.owner_momentum = any(engine.owners_hold_momentum for engine in self.engines)
        self._overlaps = [BackwardOverlap(self.muon_params, e) if self.overlap and e.owners_hold_momentum else None for e in self.engines]
        self.replicas = None
        if self.demo is not None:  # after the plans: every replica must have made the same ones
            self.replicas = Replicas(self.demo, self.replicate_group, self.device)
            self.replicas.check_adamw_layout(self.param_groups, self.param_name)
            self.transport = AcrossReplicas(self.transport, self.replicas.transport)
            params = [p for g in self.param_groups for p in g["params"]]
            self.replicas.check_consistent(params, self._names, hash(tuple(e.plan.fingerprint() for e in self.engines)))
        self._layout_ready = True

    # ------------------------------------------------------------------- step

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        settings.check_step(self.param_groups, self.param_name)
        refuse_after_partial_step(self.partially_applied)
        timer = StepTimer(self.device)
        timer.start("step")
        checkpoint.create_state(self)
        align_gradient_placements(self.param_groups)
        (streaming, reserves), failure, work = self.commit_plan, StepFailure(), StepWork(update_sq=torch.zeros((), device=self.device) if self.measure_update_rms else None)
        with phase("reserve"):  # a streaming step's memory, before anything is agreed or written
            reserved, unreserved = reserve_rounds(self.engines, self.muon_params, self.newton_schulz, self.comm_dtype, self.reservations, work.memory) if reserves else (None, None)
        with phase("check_gradients"):
            verdict = self._agree_on_gradients(unreserved)
        if verdict.skip_step:
            return loss
        if self.replicas is not None:
            with phase("demo_adamw_average"):
                self.replicas.begin_step()
                self.replicas.average_adamw_gradients(self.param_groups, self.state, failure, work)
        MatrixStep(self.muon_params, self.state, self.owner_blocks, self.storage, self.comm_dtype, self.newton_schulz,
                   self.elementwise, self.replicas, verdict, failure, timer, work, streaming, reserved).run(self.engines)  # fmt: skip
        with phase("stage_commit"):
            stage_momentum(self.storage, self._with_gradients(verdict, False), self.state, work, failure)
        with phase("agree_on_success"):
            self.partially_applied = streaming  # until every rank has succeeded
            agree_on_success(self.transport, failure, streaming)
            self.partially_applied = False
        with phase("commit"):
            commit(self.storage, self._with_gradients(verdict, False), self._with_gradients(verdict, True), self.state, work, self.elementwise)
        with phase("adamw"):
            adamw_step(self.param_groups, self.state, self.adamw_implementation)
        timer.stop("step")
        momentum = [self.state[e.param] for e in self.muon_params] + list(self.owner_blocks.values())
        self._set_metrics(step_metrics(work, timer, self.engines, self.skipped_steps, verdict.early, momentum, self.storage, self.replicas))
        return loss

    @property
    def commit_plan(self) -> tuple[bool, bool]:
        """(whether steps write each round as it returns, whether they reserve their memory first): settings.commit_plan."""
        reservable = self.storage.name == "fp32" and not self.owner_momentum and not decided_for_several_parts(self.pipeline) and bool(self.engines)
        return settings.commit_plan(self.commit_mode, reservable)

    def _agree_on_gradients(self, unreserved: str | None = None) -> Verdict:
        """Every rank's verdict on missing and non-finite gradients and on the reservation (agreement.py);
        a skipped step counts and reports only what overlap sent during its backward."""
        params = [p for g in self.param_groups for p in g["params"]]
        verdict = agree_on_gradients(params, self._names.__getitem__, self.transport, self._overlaps, self.nonfinite_grads, self.pipeline, unreserved)
        self.last_step_skipped = verdict.skip_step
        if verdict.skip_step:
            self.skipped_steps += 1
            self._set_metrics({**wire_bytes(self.engines), "muon/skipped_steps": float(self.skipped_steps)})
        return verdict

    def engine_of(self, entry: MuonParam) -> ExchangeEngine:
        """The engine that carries `entry`'s matrices (the one-rank engine, last, if this rank holds it whole)."""
        return self.engines[entry.rank_set] if entry.sharding is not None else self.engines[-1]

    def _unit_flops(self, unit: Unit) -> int:
        return self.newton_schulz.flops(self.muon_params[unit.param].group, unit.rows, unit.cols)

    def _with_gradients(self, verdict: Verdict, on_owner: bool) -> list[MuonParam]:
        """Parameters with a gradient whose momentum lives on the owners (`on_owner`) or on this rank's blocks."""
        return [e for e in self.muon_params if id(e.param) not in verdict.skipped and e.momentum_on_owner == on_owner]

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
        """Bytes of optimizer state this rank holds: AdamW moments, Muon momentum (blocks, or owned matrices)."""
        return state_bytes([*self.state.values(), *self.owner_blocks.values()])

    # ------------------------------------------------------------ checkpoints

    # Defaults for copies of optimizers pickled before these existed. partially_applied: a
    # streaming step failed after writing, so steps are refused until a checkpoint is loaded.
    hierarchical_exchange, ranks_per_node, compile_elementwise, keep_reservation = "auto", None, None, None
    last_step_skipped, commit_mode, partially_applied, measure_update_rms = False, "atomic", False, True
    _CARRIED = ("exchange_memory_mb", "rounds_in_flight", "ns_dtype_setting", "comm_dtype_setting", "nonfinite_grads",
                "row_blocks", "overlap", "adamw_implementation", "storage", "skipped_steps", "owner_blocks", "pipeline_group",
                "demo", "replicate_group", "hierarchical_exchange", "ranks_per_node", "last_step_skipped",
                "compile_elementwise", "commit_mode", "partially_applied", "keep_reservation", "measure_update_rms")  # fmt: skip

    def __getstate__(self) -> dict:
        return {**super().__getstate__(), **{key: getattr(self, key) for key in self._CARRIED}}

    def __setstate__(self, state: dict) -> None:
        """A copy (``copy.deepcopy``) plans its layout again: a collective, like construction."""
        super().__setstate__(state)
        # torch's load_state_dict comes here too: its gradient hooks must go before the re-plan adds new ones
        self._overlaps = self.__dict__.get("_overlaps", [])
        self._metrics, self._metrics_read = {}, None
        self._build_layout()

    def state_dict(self) -> dict:
        """With momentum on the owners, their blocks travel back into state tensors laid out
        like the parameters first (a collective: call it on every rank, as DCP does)."""
        return checkpoint.state_dict(self, super().state_dict())

    def load_state_dict(self, state_dict: dict) -> None:
        """Refuse state saved under another Muon/AdamW assignment, before changing anything."""
        checkpoint.load_state_dict(self, state_dict, super().load_state_dict)
        self.partially_applied = False
