"""Launcher: torchtitan's trainer with titan_muon's adapter, for the installed torchtitan.

    torchrun --nproc-per-node 2 -m titan_muon.torchtitan.train --job.config_file train_configs/llama3_gqa_muon.toml

(``-m titan_muon.train`` is an alias of this module.) The same command and TOML work on both
torchtitan versions: on 0.2.x this is torchtitan's trainer with the adapter's train specs
(titan_muon/torchtitan/v022/trainer.py); on 0.3.x the TOML is turned into a ``Trainer.Config``
(titan_muon/torchtitan/v030/launch.py). The version is read from the package metadata before
anything of torchtitan is imported, since each version's imports fail on the other.
"""

import sys

from titan_muon.torchtitan.version import uses_config_functions

if uses_config_functions():
    from titan_muon.torchtitan.v030.launch import main as _main_030

    def run() -> None:
        """Train with the command line's arguments (torchtitan 0.3's trainer, from the TOML)."""
        _main_030(sys.argv[1:], exit_when_done=True)

    __all__ = ["run"]
else:
    from titan_muon.torchtitan.v022.trainer import Trainer, check_restarts_can_rendezvous, run

    __all__ = ["Trainer", "check_restarts_can_rendezvous", "run"]

if __name__ == "__main__":
    run()
