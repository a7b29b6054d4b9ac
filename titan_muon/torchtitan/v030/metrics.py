"""Optimizer metrics in torchtitan 0.3.0's console line, TensorBoard and W&B.

The same tags as with 0.2.2 (titan_muon.torchtitan.metrics): ``optimizer/step_time_ms`` and
Muon's ``muon/*``. In 0.3.0 the metrics processor is a component with a nested ``Config``, so
selecting it is ``metrics = MuonMetricsProcessor.Config(...)`` in a config function, or on any
stock recipe ``--override.imports titan_muon.torchtitan.v030.metrics.muon_metrics``.
"""

from dataclasses import dataclass

from torchtitan.components.metrics import MetricsProcessor
from torchtitan.config import derive, override

from titan_muon.torchtitan.metrics import OptimizerMetricsProcessor


class MuonMetricsProcessor(OptimizerMetricsProcessor):
    """torchtitan's metrics processor, logging what the optimizer measured in the last step."""

    @dataclass(kw_only=True, slots=True)
    class Config(MetricsProcessor.Config):
        pass


@override(target=MetricsProcessor.Config, description="adds optimizer/step_time_ms and muon/* metrics")
def muon_metrics(config: MetricsProcessor.Config) -> MuonMetricsProcessor.Config:
    return derive(config, MuonMetricsProcessor.Config)
