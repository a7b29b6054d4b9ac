"""Launcher: torchtitan's trainer with titan_muon's adapter, on GPUs or on CPUs.

    torchrun --nproc-per-node 2 -m titan_muon.train --job.config_file train_configs/llama3_gqa_muon.toml

With CUDA this is torchtitan's trainer unchanged (NCCL). Without it, the trainer runs on
CPU processes over gloo (see titan_muon/torchtitan/cpu.py). Either way the checkpoint to
resume from is checked before it is loaded (titan_muon/torchtitan/checkpoint.py).
"""

from torchtitan.config import JobConfig
from torchtitan.train import Trainer as TorchTitanTrainer, main

from titan_muon.torchtitan import cpu
from titan_muon.torchtitan.checkpoint import check_before_resume
from titan_muon.torchtitan.config import validate_optimizer_config


class Trainer(TorchTitanTrainer):
    def __init__(self, job_config: JobConfig):
        validate_optimizer_config(job_config.optimizer)  # before minutes of setup, not after
        super().__init__(job_config)
        if cpu.should_use_cpu():
            cpu.force_sum_reductions(self.model_parts)

    def train(self):
        check_before_resume(self.checkpointer, self.job_config.checkpoint)
        super().train()


if __name__ == "__main__":
    if cpu.should_use_cpu():
        cpu.use_cpu_device()
    main(Trainer)
