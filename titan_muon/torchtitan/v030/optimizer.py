"""titan_muon's Muon as a torchtitan 0.3.0 optimizer container, and the override that selects it.

torchtitan 0.3.0 builds the optimizer from ``Trainer.Config.optimizer``, an
``OptimizersContainer.Config`` whose ``build(model_parts=...)`` constructs the class that owns
it. Its optimizer names are a fixed table (Adam, AdamW, DistMuon), so titan_muon's Muon comes in
as a subclass: :class:`MuonOptimizersContainer`, whose nested ``Config`` has the keys of the
0.2.2 ``[optimizer]`` section (titan_muon.torchtitan.config, generated from it, checked by
its ``validate_optimizer_config``) and torchtitan's ``lr``, ``weight_decay``, ``beta1``,
``beta2``, ``eps`` and ``implementation``. They are command-line flags like any other
(``--optimizer.ns_steps 3``, ``--optimizer.momentum_dtype bf16``).

It builds one :class:`titan_muon.Muon` per model part with build_param_groups (Muon: hidden
matrices, fused Q/K/V, routed experts; AdamW: embeddings, output head, router, norms, biases)
and keeps everything else of torchtitan's container: its flat FQN-keyed checkpoint state
(``state.{fqn}.{name}``, Muon's groups carry ``param_names``), its LR schedulers, its step
hooks (MoE expert-bias load balancing is a step pre-hook registered by the model's
``post_optimizer_build_fn``).

Any stock recipe switches to it with one flag::

    --override.imports titan_muon.torchtitan.v030.optimizer.muon
    --override.imports 'titan_muon.torchtitan.v030.optimizer.muon={"lr": 0.02, "ns_steps": 5}'

:func:`muon` takes the recipe's catch-all AdamW settings (lr, betas, eps, weight decay) for
Muon's AdamW groups only (``adamw_lr``, ``beta1``/``beta2``, ``eps``, ``adamw_weight_decay``);
Muon's own lr and weight decay are the Config defaults (0.02, 0.1) unless given.

With ``qk_clip = true`` it runs MuonClip after every step exactly as the 0.2.2 container does
(the same :class:`titan_muon.torchtitan.qk_clip.QKClipAfterStep`): max logits recorded by hooks on
each attention's inner attention, one MAX all-reduce over the ranks that hold the same layers, the
clip of the q and k rows (fused ``qkv_linear.wqkv`` or separate ``wq`` / ``wk``, MLA's ``wq`` /
``wq_b`` and ``wkv_b``), and the ``qk_clip/*`` metrics. Under context parallel (SDPA; FlexAttention
is refused by titan_muon.torchtitan.v030.trainer) :meth:`use_parallel_dims` rebuilds the clips with
the ``cp`` mesh's sequence layout, and the trainer tells them the run's load balancer.

Pipeline parallel: 0.3.0 builds the container without the parallel dims, which the 0.2.2 container
gets at construction. A stage's container knows it is one from its model parts (torchtitan's split
leaves None for the modules a stage does not hold) and waits for :meth:`use_parallel_dims`, which
titan_muon.torchtitan.v030.trainer calls once torchtitan's setup is done: each Muon then joins the
pipeline group (a non-finite gradient in any stage raises or skips in every stage) and MuonClip is
built over the stage's data-parallel and tensor-parallel groups. Until then it refuses to step.

DeMo (``demo = true``): the replicas' group comes from the parallel dims that titan_muon's trainer
lends while torchtitan builds the container (:func:`building_with`); built without it, the container
refuses ``demo``.

Not supported here (refused, naming the setting): torchtitan's ``param_groups`` table and
``optimizer_factory_kwargs_by_name`` (the split is build_param_groups'; use ``adamw_patterns``
/ ``muon_patterns``), ``implementation = "fused_opt_states_bf16"``.
"""

import dataclasses
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import MISSING, dataclass, field, fields, make_dataclass
from types import SimpleNamespace
from typing import Any

import torch.distributed as dist
import torch.nn as nn
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.config import override
from torchtitan.distributed import ParallelDims
from torchtitan.tools.logging import logger

from titan_muon import Muon
from titan_muon.step.agreement import agreeing_model_parts
from titan_muon.torchtitan import config as optimizer_section
from titan_muon.torchtitan.config import validate_optimizer_config
from titan_muon.torchtitan.metrics import measure_logged_steps_only, time_optimizer_steps
from titan_muon.torchtitan.muon import build_muon, merged_step_metrics, muon_kwargs
from titan_muon.torchtitan.qk_clip import QKClipAfterStep
from titan_muon.torchtitan.replicas import check_replicas


def _copied(f: dataclasses.Field) -> tuple[str, Any, dataclasses.Field]:
    if f.default_factory is not MISSING:
        return f.name, f.type, field(default_factory=f.default_factory)
    return f.name, f.type, field(default=f.default)


# The [optimizer] keys of titan_muon.torchtitan.config, as keyword-only slotted fields on top of
# torchtitan's OptimizersContainer.Config: one list of keys for 0.2.2 and 0.3.0.
_MuonSection = make_dataclass(
    "MuonSection",
    [_copied(f) for f in fields(optimizer_section.Optimizer)],
    bases=(OptimizersContainer.Config,),
    kw_only=True,
    slots=True,
)
_MuonSection.__module__ = __name__


class MuonOptimizersContainer(QKClipAfterStep, OptimizersContainer):
    """One :class:`titan_muon.Muon` per model part, each with its own Muon / AdamW split; MuonClip
    after each step with ``qk_clip = true``."""

    @dataclass(kw_only=True, slots=True)
    class Config(_MuonSection):
        lr: float = 0.02
        """Muon's learning rate (hidden matrices, experts); also AdamW's unless adamw_lr is set."""

        weight_decay: float = 0.1
        """Decoupled weight decay of both Muon and AdamW groups (unless adamw_weight_decay is set)."""

        beta1: float = 0.9
        """AdamW groups' beta1."""

        beta2: float = 0.95
        """AdamW groups' beta2."""

        eps: float = 1e-8
        """AdamW groups' eps."""

    optimizers: list[Muon]

    def __init__(self, config: Config, *, model_parts: list[nn.Module]) -> None:
        check_config(config)
        kwargs = muon_kwargs(config)
        if config.demo:  # the optimizer owns the replicate dimension (FSDP2 runs on the fsdp mesh only)
            kwargs["replicate_group"] = replicate_group_for_demo()
        self.config = config
        self.model_parts = model_parts
        # 0.3.0 builds the optimizer without the parallel dims: a pipeline stage is known here by its
        # model parts, its pipeline group only from use_parallel_dims (titan_muon's trainer calls it)
        self.pipeline_stage = len(model_parts) > 1 or any(is_pipeline_stage(part) for part in model_parts)
        self.parallel_dims = None
        # a pipeline stage may hold no attention layer
        self.optimizers = [build_muon(model, config, kwargs, pipeline=self.pipeline_stage) for model in model_parts]
        params = [p for opt in self.optimizers for group in opt.param_groups for p in group["params"]]
        self._validate_params(params)
        self._post_init(params)
        # torchtitan 0.3.0 wraps each inner attention's forward for context parallel before the
        # optimizer is built; MuonClip then records each rank's sequence slice and needs the CP
        # layout from use_parallel_dims (a stock Trainer never calls it: refuse to step, below).
        self.context_parallel_model = any(
            getattr(module.__dict__.get("forward"), "__name__", "") == "cp_forward" for part in model_parts for module in part.modules()
        )
        self.qk_clips, self.qk_clip_metrics = [], []
        if not self.pipeline_stage:  # the world reduces max logits: every rank holds every layer
            self._build_qk_clips(model_parts, config)
        time_optimizer_steps(self)
        measure_logged_steps_only(self)

    def use_parallel_dims(self, parallel_dims: ParallelDims) -> None:
        """What the 0.2.2 container gets at construction: under pipeline parallel, each Muon's
        pipeline group (a non-finite gradient in any stage raises or skips in every stage) and
        MuonClip's max logits reduced over this rank's stage only. Call once, before the first step."""
        self.parallel_dims = parallel_dims
        if parallel_dims.cp_enabled and not parallel_dims.pp_enabled:  # the clips' sequence layout
            self._rebuild_qk_clips(parallel_dims)
        if not parallel_dims.pp_enabled:
            return
        pipeline_group = parallel_dims.get_mesh("pp").get_group()
        for optimizer in self.optimizers:
            optimizer.set_pipeline_group(pipeline_group)
        self._rebuild_qk_clips(parallel_dims)
        logger.info(
            f"titan_muon Muon under pipeline parallel: stages agree on non-finite gradients with ranks "
            f"{dist.get_process_group_ranks(pipeline_group)}"
            + (", MuonClip reduces max logits within the stage" if self.config.qk_clip else "")
        )

    def _rebuild_qk_clips(self, parallel_dims: ParallelDims) -> None:
        for qk_clip in self.qk_clips:
            if qk_clip is not None:
                qk_clip.remove()
        self._build_qk_clips(self.model_parts, self.config, parallel_dims)

    def step(self, *args, **kwargs) -> None:
        if self.pipeline_stage and self.parallel_dims is None:
            raise RuntimeError(
                "titan_muon's Muon under pipeline parallel needs the pipeline's process groups, which torchtitan "
                "0.3.0 does not hand to the optimizer: train with titan_muon's trainer (python -m titan_muon.train, "
                "or a Trainer.Config from titan_muon.torchtitan.v030), or call optimizers.use_parallel_dims("
                "parallel_dims) after building the trainer"
            )
        if self.config.qk_clip and self.context_parallel_model and self.parallel_dims is None:
            raise RuntimeError(
                "titan_muon's MuonClip under context parallel needs the sequence layout, which torchtitan 0.3.0 does "
                "not hand to the optimizer (without it each rank's max logits miss the query-key pairs across ranks): "
                "train with titan_muon's trainer (python -m titan_muon.train, or a Trainer.Config from "
                "titan_muon.torchtitan.v030), or call optimizers.use_parallel_dims(parallel_dims) after building the "
                "trainer; or set qk_clip = false"
            )
        with agreeing_model_parts(self.optimizers):  # several parts per rank skip, raise or step as one
            super().step(*args, **kwargs)

    @property
    def last_step_metrics(self) -> dict[str, float]:
        """The last step's Muon metrics (``muon/*``), merged over model parts, and MuonClip's (``qk_clip/*``)."""
        return merged_step_metrics(self.optimizers) | self.qk_clip_step_metrics()


# The parallel dims of the trainer being built. torchtitan 0.3.0 builds the optimizer from its config
# alone; DeMo needs the replicate group at construction (each replica owns its momenta), so titan_muon's
# trainer lends its dims (known once torchtitan has initialized distributed) for its setup.
_TRAINER_PARALLEL_DIMS: ContextVar[Callable[[], ParallelDims | None] | None] = ContextVar("titan_muon_parallel_dims", default=None)


@contextmanager
def building_with(parallel_dims: Callable[[], ParallelDims | None]) -> Iterator[None]:
    """Containers built inside this block may ask ``parallel_dims()`` for the trainer's dims."""
    token = _TRAINER_PARALLEL_DIMS.set(parallel_dims)
    try:
        yield
    finally:
        _TRAINER_PARALLEL_DIMS.reset(token)


def replicate_group_for_demo() -> dist.ProcessGroup:
    lent = _TRAINER_PARALLEL_DIMS.get()
    parallel_dims = lent() if lent is not None else None
    if parallel_dims is None:
        raise RuntimeError(
            "[optimizer] demo = true under torchtitan 0.3.0 needs titan_muon's trainer (python -m titan_muon.train, "
            "or a Trainer.Config from titan_muon.torchtitan.v030): it shards the model over each replica's fsdp mesh "
            "only and hands the optimizer the data_parallel_replicate group, which a stock Trainer does not"
        )
    check_replicas(parallel_dims)
    return parallel_dims.get_mesh("dp_replicate").get_group()


def is_pipeline_stage(model_part: nn.Module) -> bool:
    """Whether ``model_part`` is a stage of torchtitan 0.3.0's pipeline split, which replaces the
    top-level modules a stage does not hold by None (the first stage has no ``norm`` and
    ``lm_head``, the last no ``tok_embeddings``)."""
    return any(getattr(model_part, name, False) is None for name in ("tok_embeddings", "norm", "lm_head"))


def check_config(config: MuonOptimizersContainer.Config) -> None:
    """Raise ``ValueError`` naming the first bad key (the 0.2.2 checks, and what 0.3.0 lacks)."""
    section = SimpleNamespace(**{f.name: getattr(config, f.name) for f in fields(config)}, name="Muon")
    validate_optimizer_config(section)
    if config.param_groups:
        raise ValueError(
            "optimizer.param_groups is torchtitan's per-pattern optimizer table; titan_muon's Muon splits the "
            "parameters itself (build_param_groups): move parameters with optimizer.adamw_patterns / muon_patterns"
        )
    if config.optimizer_factory_kwargs_by_name:
        raise ValueError("optimizer.optimizer_factory_kwargs_by_name has no meaning for titan_muon's Muon")


# The recipe's AdamW settings go to Muon's AdamW groups only: Config.eps, beta1 and beta2 are the
# AdamW groups' already; lr and weight_decay are Muon's own, so AdamW's go to adamw_lr / adamw_weight_decay.
_STOCK_KEYS = {"lr": "adamw_lr", "eps": "eps", "weight_decay": "adamw_weight_decay"}


def stock_adamw_settings(config: OptimizersContainer.Config) -> dict[str, Any]:
    """Muon-container settings carrying over a stock config's AdamW: the lr, betas, eps and
    weight decay of its last Adam/AdamW param group (by torchtitan's convention the catch-all)."""
    groups = [g for g in config.param_groups if g.optimizer_name in ("AdamW", "Adam")]
    if not groups:
        return {}
    kwargs = groups[-1].optimizer_kwargs
    settings = {ours: kwargs[theirs] for theirs, ours in _STOCK_KEYS.items() if theirs in kwargs}
    if "betas" in kwargs:
        settings["beta1"], settings["beta2"] = (float(b) for b in kwargs["betas"])
    return settings


@override(
    target=OptimizersContainer.Config,
    description="titan_muon's Muon for hidden matrices and experts, AdamW for the rest",
)
def muon(config: OptimizersContainer.Config, **settings: Any) -> MuonOptimizersContainer.Config:
    """Replace the recipe's optimizer by :class:`MuonOptimizersContainer`.

    ``settings`` (the JSON of ``--override.imports 'titan_muon.torchtitan.v030.optimizer.muon={...}'``)
    set any key of the Config; the recipe's AdamW lr, betas, eps and weight decay go to the AdamW groups.
    """
    if isinstance(config, MuonOptimizersContainer.Config):
        return dataclasses.replace(config, **settings)
    carried = stock_adamw_settings(config)
    implementation = "fused" if config.implementation == "fused_opt_states_bf16" else config.implementation
    replacement = MuonOptimizersContainer.Config(implementation=implementation, **{**carried, **settings})
    logger.info(f"titan_muon Muon replaces the recipe's optimizer; carried over from its AdamW: {carried}")
    return replacement
