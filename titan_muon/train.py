"""Alias of :mod:`titan_muon.torchtitan.train`, the TorchTitan launcher.

    torchrun --nproc-per-node 2 -m titan_muon.train --job.config_file train_configs/llama3_gqa_muon.toml

Needs the ``torchtitan`` extra (docs/torchtitan.md#install); ``import titan_muon``
does not import this module.
"""

from titan_muon.torchtitan.train import *  # noqa: F403  (what the launcher exports for the installed torchtitan)
from titan_muon.torchtitan.train import run

if __name__ == "__main__":
    run()
