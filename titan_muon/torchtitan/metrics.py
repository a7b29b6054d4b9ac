"""Optimizer metrics in torchtitan's console line, TensorBoard and W&B.

torchtitan's trainer hands the loss and grad norm to ``MetricsProcessor.log`` and sets
``metrics_processor.optimizers`` to the optimizers container; the train spec's
``build_metrics_processor_fn`` lets us supply a processor that adds what the optimizer
measured during the last step. Tags (see docs/torchtitan.md):

* ``optimizer/step_time_ms``: wall time of the whole optimizer step (Muon or AdamW);
* ``muon/*``: ``titan_muon.Muon.last_step_metrics`` (update RMS, bytes sent/received, ...).

Values are rank 0's view of the step just logged (bytes differ slightly between ranks). The
update RMS costs a sum in the commit's pass (eagerly a read of every update), so only the steps
torchtitan logs measure it (:func:`measure_logged_steps_only`).
"""

import itertools
import time
from collections.abc import Callable
from typing import Any

from torchtitan.components.metrics import MetricsProcessor
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.tools.logging import logger


def time_optimizer_steps(optimizers: OptimizersContainer) -> None:
    """Record each step's duration on ``optimizers.last_step_time_ms``."""
    started = 0.0

    def before_step(*_) -> None:
        nonlocal started
        started = time.perf_counter()

    def after_step(*_) -> None:
        optimizers.last_step_time_ms = 1e3 * (time.perf_counter() - started)

    optimizers.register_step_pre_hook(before_step)
    optimizers.register_step_post_hook(after_step)


def measure_logged_steps_only(optimizers: OptimizersContainer) -> None:
    """Each Muon of the container measures ``muon/update_rms`` only in the steps whose metrics
    are logged (``Muon.measure_update_rms``). The processor says after logging step s how many
    steps away the next logged one is (``steps_to_next_log``, :func:`note_logged_step`);
    until it has logged once (a fresh or resumed run), and if a due log does not come, every step measures."""
    optimizers.steps_to_next_log = None

    def before_step(*_) -> None:
        due = optimizers.steps_to_next_log is None or optimizers.steps_to_next_log <= 1
        for opt in getattr(optimizers, "optimizers", ()):
            if hasattr(opt, "measure_update_rms"):
                opt.measure_update_rms = due

    def after_step(*_) -> None:
        if optimizers.steps_to_next_log is not None:
            optimizers.steps_to_next_log -= 1

    optimizers.register_step_pre_hook(before_step)
    optimizers.register_step_post_hook(after_step)


def note_logged_step(optimizers: OptimizersContainer | None, step: int, should_log: Callable[[int], bool]) -> None:
    """After logging `step`: the next step logged (torchtitan's ``should_log``) is the next that
    measures, where measure_logged_steps_only was applied."""
    if hasattr(optimizers, "steps_to_next_log"):
        optimizers.steps_to_next_log = next(s for s in itertools.count(step + 1) if should_log(s)) - step


def optimizer_metrics(optimizers: OptimizersContainer | None) -> dict[str, float]:
    metrics = {}
    if hasattr(optimizers, "last_step_time_ms"):
        metrics["optimizer/step_time_ms"] = optimizers.last_step_time_ms
    metrics.update(getattr(optimizers, "last_step_metrics", {}))
    return metrics


class OptimizerMetricsProcessor(MetricsProcessor):
    def log(
        self,
        step: int,
        global_avg_loss: float,
        global_max_loss: float,
        grad_norm: float,
        extra_metrics: dict[str, Any] | None = None,
    ) -> None:
        metrics = optimizer_metrics(self.optimizers)
        super().log(step, global_avg_loss, global_max_loss, grad_norm, {**(extra_metrics or {}), **metrics})
        if metrics:
            logger.info(f"step: {step:2}  " + "  ".join(f"{key}: {value:.4g}" for key, value in metrics.items()))
        note_logged_step(self.optimizers, step, self.should_log)


def build_metrics_processor(job_config, parallel_dims, model_args=None, tag: str | None = None) -> MetricsProcessor:
    return OptimizerMetricsProcessor(job_config, parallel_dims, tag)
