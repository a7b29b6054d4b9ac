"""titan_muon.train on torchtitan 0.3.0 with a non-finite gradient injected, for tests/test_torchtitan030.py.

    torchrun ... scripts/fault_train030.py --job.config_file ...    (the arguments of python -m titan_muon.train)

FAULT_NONFINITE_GRAD_AT_STEP=N: in the backward of step N, rank FAULT_RANK (default 1) multiplies the
gradient flowing into the model's output by NaN, so every parameter's gradient on that rank turns NaN
(and, once reduced, on every rank). The forward and the loss stay finite: torchtitan 0.3.0 stops the
run on a non-finite loss, while a non-finite gradient is left to the optimizer, whose
``nonfinite_grads`` setting raises or skips the step.

Nothing here is used by titan_muon itself.
"""

import os

import torch

from titan_muon.torchtitan.v030 import launch
from titan_muon.torchtitan.v030.trainer import MuonTrainer


def nonfinite_grad_step() -> int | None:
    value = os.environ.get("FAULT_NONFINITE_GRAD_AT_STEP")
    this_rank = os.environ.get("RANK") == os.environ.get("FAULT_RANK", "1")
    return int(value) if value and this_rank else None


def poison_output_gradient(module, args, output):
    output.register_hook(lambda grad: grad * float("nan"))


def inject_nonfinite_gradient(step: int) -> None:
    forward_backward_step = MuonTrainer.forward_backward_step

    def poisoned_at_step(self, **kwargs) -> torch.Tensor:
        if self.step != step:
            return forward_backward_step(self, **kwargs)
        hooks = [part.register_forward_hook(poison_output_gradient) for part in self.model_parts]
        try:
            return forward_backward_step(self, **kwargs)
        finally:
            for hook in hooks:
                hook.remove()

    MuonTrainer.forward_backward_step = poisoned_at_step


if __name__ == "__main__":
    if (step := nonfinite_grad_step()) is not None:
        inject_nonfinite_gradient(step)
    launch.main()
