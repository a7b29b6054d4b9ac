"""Launch torchtitan 0.3.0 from a 0.2.2-style TOML file, or from a config function.

    torchrun --nproc-per-node 2 -m titan_muon.torchtitan.v030.launch \\
        --job.config_file train_configs/llama3_gqa_muon.toml --training.steps 50
    torchrun --nproc-per-node 2 -m titan_muon.torchtitan.v030.launch \\
        --module titan_muon.torchtitan.v030 --config llama3_gqa_muon --training.steps 50

torchtitan 0.3.0 reads no TOML; :func:`main` builds its ``Trainer.Config`` (a
titan_muon.torchtitan.v030.trainer ``MuonTrainer.Config``) from the files in train_configs/, so one
config format serves both torchtitan versions:

* ``[model] name / flavor`` pick the model (titan_muon.torchtitan.v030.models), ``[training]
  dataset / dataset_path`` the dataloader and the offline tokenizer, ``[optimizer] name`` the
  optimizer: "Muon" is :class:`MuonOptimizersContainer` with every other ``[optimizer]`` key,
  "AdamW" / "Adam" torchtitan's own (lr, beta1, beta2, eps, weight_decay, implementation);
* ``[job] dump_folder`` and ``[model] hf_assets_path`` are 0.3.0's top-level ``dump_folder`` and
  ``hf_assets_path``; ``[activation_checkpoint] mode`` "none" / "full" / "selective" its policies;
* the keys of ``[training]``, ``[lr_scheduler]``, ``[metrics]``, ``[checkpoint]``,
  ``[parallelism]``, ``[debug]``, ``[comm]``, ``[compile]`` have the same names in 0.3.0;
* ``[job] description / custom_config_module`` and ``[experimental] custom_import`` are 0.2.2
  plumbing and are ignored. Any other key is an error naming it.
* CUDA graphs (new in 0.3.0, which captures forward + backward) are off, as 0.2.2 had none;
  ``--training.no-disable_cuda_graphs`` turns them on (not with ``optimizer.overlap``).

Command-line overrides use the same 0.2.2 names (``--model.flavor tiny_gqa``,
``--job.dump_folder DIR``, ``--optimizer.ns_steps 3``, ``--optimizer.no-overlap``,
``--checkpoint.enable``); the ``--optimizer.*``, ``--model.*``, ``--training.dataset*`` and
``--activation_checkpoint.mode`` ones are folded into the TOML, the rest go to torchtitan's own
parser (tyro) with the built config as default, so 0.3.0's own flags work too.

With ``--module`` / ``--config`` the config function is loaded by torchtitan's ConfigManager as in
``python -m torchtitan.train``: ours (titan_muon.torchtitan.v030.config_registry) or any stock recipe,
whose plain ``Trainer.Config`` is turned into a ``MuonTrainer.Config`` (the same fields), so it gets
the CPU shims too; add ``--override.imports titan_muon.torchtitan.v030.optimizer.muon`` for Muon.
Either way the run is torchtitan's (build, train or seed checkpoint, close).
"""

import os
import sys
import tomllib
import types
from dataclasses import fields
from typing import Any, Literal, Union, get_args, get_origin

import torch
from torchtitan.components.optimizer import OptimizersContainer, ParamGroupConfig
from torchtitan.config import ConfigManager
from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
from torchtitan.tools.logging import init_logger, logger

from titan_muon.torchtitan.config import validate_optimizer_config
from titan_muon.torchtitan.teardown import exit_now
from titan_muon.torchtitan.v030 import cpu
from titan_muon.torchtitan.v030.config_registry import trainer_config
from titan_muon.torchtitan.v030.optimizer import MuonOptimizersContainer
from titan_muon.torchtitan.v030.trainer import as_muon_trainer

# 0.2.2 key -> attribute path in 0.3.0's Trainer.Config
RENAMED = {
    "job.dump_folder": "dump_folder",
    "model.hf_assets_path": "hf_assets_path",
}
# keys that choose what is built (read before building; overridable on the command line)
CHOSEN = ("model.name", "model.flavor", "training.dataset", "training.dataset_path", "activation_checkpoint.mode")
IGNORED = ("job.description", "job.custom_config_module", "job.config_file", "experimental.custom_import")
SECTIONS = ("training", "lr_scheduler", "metrics", "checkpoint", "parallelism", "debug", "comm", "compile")
# torchtitan 0.2.2's [optimizer] defaults for the keys that are torchtitan's own
TORCHTITAN_022_OPTIMIZER = dict(
    name="AdamW", lr=8e-4, eps=1e-8, beta1=0.9, beta2=0.95, weight_decay=0.1, implementation="fused"
)
ACTIVATION_CHECKPOINTS = {"none": lambda: None, "full": FullAC.Config, "selective": SelectiveAC.Config}

_OPTIMIZER_TYPES = {f.name: f.type for f in fields(MuonOptimizersContainer.Config)} | {"name": str}


def _convert(key: str, hint: Any, raw: str) -> Any:
    """A command-line string as the value of a field of type ``hint``."""
    origin = get_origin(hint)
    if origin in (Union, types.UnionType):
        if raw.lower() in ("none", "null"):
            return None
        return _convert(key, next(arg for arg in get_args(hint) if arg is not type(None)), raw)
    if hint is bool:
        if raw.lower() not in ("true", "false", "1", "0"):
            raise ValueError(f"--{key}: expected true or false, got {raw!r}")
        return raw.lower() in ("true", "1")
    if origin is list:
        return [part for part in raw.split(",") if part]
    if origin is Literal or hint is str:
        return raw
    return hint(raw)


def _fold(argv: list[str], sections: dict[str, dict]) -> list[str]:
    """Move the ``--optimizer.*`` and :data:`CHOSEN` flags of ``argv`` into ``sections`` (the
    parsed TOML); return the other arguments, with the :data:`RENAMED` flags renamed."""
    rest, i = [], 0
    while i < len(argv):
        token = argv[i]
        flag, has_value, inline = token.partition("=")
        key = flag[2:].replace("-", "_") if flag.startswith("--") else ""
        section, _, name = key.partition(".")
        if key in CHOSEN or section == "optimizer":
            hint = _OPTIMIZER_TYPES.get(name, str) if section == "optimizer" else str
            negated = name.startswith("no_") and _OPTIMIZER_TYPES.get(name[3:]) is bool and section == "optimizer"
            if negated:
                value = False
                name = name[3:]
            elif has_value:
                value = _convert(key, hint, inline)
            elif hint is bool and (i + 1 == len(argv) or argv[i + 1].startswith("--")):
                value = True
            elif i + 1 < len(argv):
                i += 1
                value = _convert(key, hint, argv[i])
            else:
                raise ValueError(f"{token} needs a value")
            sections.setdefault(section, {})[name] = value
        elif key in RENAMED:
            rest.append("--" + RENAMED[key] + (f"={inline}" if has_value else ""))
        elif key in IGNORED:
            if not has_value and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                i += 1
        else:
            rest.append(token)
        i += 1
    return rest


def optimizer_config(section: dict[str, Any]) -> OptimizersContainer.Config:
    """The ``[optimizer]`` section as a 0.3.0 optimizer config (see the module docstring)."""
    section = {**TORCHTITAN_022_OPTIMIZER, **section}
    section.pop("early_step_in_backward", None)
    unknown = set(section) - set(_OPTIMIZER_TYPES)
    if unknown:
        raise ValueError(f"[optimizer] {sorted(unknown)[0]} is not a titan_muon or torchtitan optimizer key")
    name = section.pop("name")
    if name == "Muon":
        return MuonOptimizersContainer.Config(**section)
    muon_defaults = MuonOptimizersContainer.Config()  # titan_muon's keys are checked even for AdamW, as with 0.2.2
    defaults = {f.name: getattr(muon_defaults, f.name) for f in fields(muon_defaults)}
    validate_optimizer_config(types.SimpleNamespace(**{**defaults, **section, "name": name}))
    kwargs = dict(lr=section["lr"], betas=(section["beta1"], section["beta2"]), eps=section["eps"],
                  weight_decay=section["weight_decay"])  # fmt: skip
    group = ParamGroupConfig(pattern=".*", optimizer_name=name, optimizer_kwargs=kwargs)
    return OptimizersContainer.Config(param_groups=[group], implementation=section["implementation"])


def _set(config, path: str, value: Any, where: str) -> None:
    *parents, name = path.split(".")
    target = config
    for parent in parents:
        target = getattr(target, parent)
    if name not in {f.name for f in fields(target)}:
        raise ValueError(f"{where} is not a torchtitan 0.3.0 setting ({type(target).__qualname__} has no {name!r})")
    setattr(target, name, value)


def config_from_toml(path: str, argv: list[str]) -> tuple[Any, list[str]]:
    """``(MuonTrainer.Config, arguments left for torchtitan's parser)`` from a TOML file and overrides."""
    with open(path, "rb") as f:
        sections = tomllib.load(f)
    rest = _fold(argv, sections)
    model, training = sections.get("model", {}), sections.get("training", {})
    dataset = training.get("dataset", "python_stdlib")
    config = trainer_config(
        model.get("name", "titan_muon_llama3"), model.get("flavor", "debugmodel_gqa"),
        optimizer_config(sections.get("optimizer", {})), dataset,
    )  # fmt: skip
    config.dataloader.dataset_path = config.tokenizer.dataset_path = training.get("dataset_path")
    mode = sections.get("activation_checkpoint", {}).get("mode", "selective")
    if mode not in ACTIVATION_CHECKPOINTS:
        raise ValueError(f"[activation_checkpoint] mode must be one of {sorted(ACTIVATION_CHECKPOINTS)}, got {mode!r}")
    config.activation_checkpoint = ACTIVATION_CHECKPOINTS[mode]()
    # as with 0.2.2, which has none: no CUDA graph of forward + backward (--training.no-disable_cuda_graphs)
    config.training.disable_cuda_graphs = True
    for section, values in sections.items():
        if section == "optimizer":
            continue
        for key, value in values.items():
            full = f"{section}.{key}"
            if full in CHOSEN or full in IGNORED:
                continue
            if full in RENAMED:
                _set(config, RENAMED[full], value, f"[{section}] {key}")
            elif section in SECTIONS:
                _set(config, full, value, f"[{section}] {key}")
            else:
                raise ValueError(f"[{section}] {key} has no torchtitan 0.3.0 counterpart that this launcher knows")
    if cpu.should_use_cpu():
        cpu.adapt_config(config)
    return config, rest


class _TomlConfigManager(ConfigManager):
    """torchtitan's ConfigManager, loading the config from a TOML file instead of ``--module``/``--config``."""

    def __init__(self, config_file: str):
        super().__init__()
        self.config_file = config_file

    def _load_config(self, args: list[str]) -> tuple[object, list[str]]:
        return config_from_toml(self.config_file, args)


def _config_file(argv: list[str]) -> str | None:
    for i, token in enumerate(argv):
        if token.startswith("--job.config_file=") or token.startswith("--job.config-file="):
            return token.partition("=")[2]
        if token in ("--job.config_file", "--job.config-file") and i + 1 < len(argv):
            return argv[i + 1]
    return None


def parse(argv: list[str]):
    """The Trainer.Config of a command line (TOML file or ``--module``/``--config``)."""
    config_file = _config_file(argv)
    manager = _TomlConfigManager(config_file) if config_file else ConfigManager()
    return manager.parse_args(argv)


def main(argv: list[str] | None = None, exit_when_done: bool = False) -> None:
    """Build the config from ``argv`` (default ``sys.argv[1:]``) and run torchtitan 0.3.0's trainer.

    ``exit_when_done`` (the ``python -m titan_muon.train`` entry point): after a successful run and
    the trainer's close, end the process at once instead of tearing down the process group and the
    interpreter (titan_muon/torchtitan/teardown.py)."""
    init_logger()
    cpu.add_set_timeout()
    config = as_muon_trainer(parse(sys.argv[1:] if argv is None else argv))  # a stock recipe gets the shims too
    trainer = None
    succeeded = False
    try:
        trainer = config.build()
        if config.checkpoint.create_seed_checkpoint:
            if int(os.environ.get("WORLD_SIZE", "1")) != 1:
                raise ValueError("a seed checkpoint is created by a single process (--nproc-per-node 1)")
            trainer.checkpointer.save(curr_step=0, last_step=True)
            logger.info("Created seed checkpoint")
        else:
            trainer.train()
        if torch.distributed.is_initialized():
            # Leave together: 0.3.0's rank 0 sleeps 2 s after training while the others tear down
            # at once, and a rank tearing down alone now and then aborted at exit ("terminate called
            # without an active exception", docs/torchtitan.md). Only after success: a rank that
            # raised must not wait here for ranks that never arrive.
            torch.distributed.barrier()
        succeeded = True
    finally:
        if trainer is not None:
            trainer.close()
        if succeeded and exit_when_done:
            exit_now()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
