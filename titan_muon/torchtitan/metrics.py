"""Optimizer metrics in torchtitan's console line, TensorBoard and W&B.

torchtitan's trainer hands the loss and grad norm to ``MetricsProcessor.log`` and sets
``metrics_processor.optimizers`` to the optimizers container; the train spec's
``build_metrics_processor_fn`` lets us supply a processor that adds what the optimizer
measured during the last step. Tags (see docs/torchtitan.md):

* ``optimizer/step_time_ms``: wall time of the whole optimizer step (Muon or AdamW);
* ``muon/*``: ``titan_muon.Muon.last_step_metrics`` (update RMS, bytes sent/received, ...).

Values are rank 0's view of the step just logged (bytes differ slightly between ranks).
"""

import time
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


def build_metrics_processor(job_config, parallel_dims, model_args=None, tag: str | None = None) -> MetricsProcessor:
    return OptimizerMetricsProcessor(job_config, parallel_dims, tag)
