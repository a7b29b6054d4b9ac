"""Check the checkpoint a run is about to resume from, before torchtitan loads it.

torchtitan (0.2.2 and 0.3.0 alike) resumes from the newest ``step-N`` folder that has a
``.metadata`` file (DCP writes it last, after every rank's shards): a save interrupted before
writing it is skipped without a word, a truncated shard fails deep inside DCP, and a checkpoint written
under another optimizer setup fails with a bare "Missing key". This module reads only the
DCP metadata and the file sizes, before anything is loaded:

* interrupted saves newer than the checkpoint torchtitan picks are named in a warning, so
  an automatic restart (torchrun ``--max-restarts``) resumes from the previous complete
  step and says so; an interrupted ``--checkpoint.load_step`` or
  ``--checkpoint.initial_load_path`` is refused;
* a missing or truncated shard, or a checkpoint that does not fit this model or this
  optimizer setup, raises one error naming the folder, what is wrong and what to do.

Bit flips inside a shard cannot be seen: DCP stores no checksums.
"""

import os
import re
from collections import defaultdict
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torchtitan.tools.logging import logger

_STEP_DIR = re.compile(r"step-(\d+)$")


class CheckpointError(RuntimeError):
    pass


def step_folders(folder: str) -> dict[int, str]:
    """``{step: path}`` of the ``step-N`` folders in ``folder`` (none if it does not exist)."""
    if not os.path.isdir(folder):
        return {}
    return {int(m.group(1)): os.path.join(folder, name) for name in os.listdir(folder) if (m := _STEP_DIR.match(name))}


def is_complete(path: str) -> bool:
    """As torchtitan decides it: DCP's ``.metadata``, or the index of a Hugging Face save."""
    return any(os.path.isfile(os.path.join(path, name)) for name in (".metadata", "model.safetensors.index.json"))


def checkpoint_to_resume(folder: str, load_step: int) -> tuple[int, str] | None:
    """``(step, path)`` of the folder torchtitan will load; an incomplete ``load_step`` is refused."""
    steps = step_folders(folder)
    if load_step != -1:
        if load_step not in steps:
            return None  # torchtitan reports the missing folder itself
        if not is_complete(steps[load_step]):
            raise CheckpointError(
                f"checkpoint {steps[load_step]} is incomplete: it has no .metadata file (was its save "
                "interrupted?). Choose another --checkpoint.load_step."
            )
        return load_step, steps[load_step]
    complete = [step for step, path in steps.items() if is_complete(path)]
    return (max(complete), steps[max(complete)]) if complete else None


def interrupted_saves(folder: str, resume_step: int | None) -> list[str]:
    """``step-N`` folders newer than ``resume_step`` (all, if None) that a save left incomplete."""
    steps = step_folders(folder)
    newer = sorted(step for step in steps if resume_step is None or step > resume_step)
    return [steps[step] for step in newer if not is_complete(steps[step])]


def warn_skipped(skipped: list[str], resume: tuple[int, str] | None, initial: str | None = None) -> None:
    """``initial``: the ``checkpoint.initial_load_path`` torchtitan falls back to (0.3.0), if any."""
    if resume:
        target = f"the previous complete checkpoint {resume[1]}"
    else:
        target = f"checkpoint.initial_load_path {initial}" if initial else "scratch (no complete checkpoint)"
    logger.warning(
        f"Skipping incomplete checkpoint(s) {skipped}: no .metadata, a save was interrupted. "
        f"Resuming from {target}. The next save of that step overwrites the folder."
    )


def read_metadata(path: str) -> Metadata:
    try:
        metadata = FileSystemReader(path).read_metadata()
    except Exception as error:
        raise CheckpointError(f"checkpoint {path}: cannot read .metadata ({error!r}); the file is damaged") from error
    needed: dict[str, int] = defaultdict(int)
    for info in metadata.storage_data.values():
        needed[info.relative_path] = max(needed[info.relative_path], info.offset + info.length)
    for name, size in sorted(needed.items()):
        file = os.path.join(path, name)
        actual = os.path.getsize(file) if os.path.isfile(file) else None
        if actual is None:
            raise CheckpointError(f"checkpoint {path}: shard {name} is missing")
        if actual < size:
            raise CheckpointError(f"checkpoint {path}: shard {name} is truncated ({actual} of {size} bytes)")
    return metadata


def _param_of(state_key: str) -> tuple[str, str]:
    """"state.layers.0.attention.wq.weight.exp_avg" -> ("layers.0.attention.wq.weight", "exp_avg")."""
    fqn, _, name = state_key.removeprefix("state.").rpartition(".")
    return fqn, name


def compare_optimizer_state(saved: Metadata, expected: dict[str, Any], path: str, pipeline_stage: bool = False) -> None:
    """Raise if the saved per-parameter optimizer state differs from what this run builds.

    ``pipeline_stage``: this rank holds one pipeline stage's parameters, so only those are
    compared; the checkpoint's other parameters are other stages'."""
    saved_keys = {
        key.removeprefix("optimizer."): meta
        for key, meta in saved.state_dict_metadata.items()
        if key.startswith("optimizer.state.")
    }
    if not saved_keys:
        raise CheckpointError(
            f"checkpoint {path} holds no optimizer state (saved with last_save_model_only?). To start "
            "from its weights with a fresh optimizer set [checkpoint] exclude_from_loading = "
            '["optimizer", "lr_scheduler", "dataloader", "train_state"] in the TOML'
            " (the same list on the command line: comma-separated on torchtitan 0.2.2, space-separated on 0.3.0)"
        )
    saved_by_param, expected_by_param = defaultdict(set), defaultdict(set)
    for key in saved_keys:
        fqn, name = _param_of(key)
        saved_by_param[fqn].add(name)
    for key in expected:
        if key.startswith("state."):
            fqn, name = _param_of(key)
            expected_by_param[fqn].add(name)
    problems = []
    compared = set(expected_by_param) if pipeline_stage else set(saved_by_param) | set(expected_by_param)
    for fqn in sorted(compared):
        have, want = sorted(saved_by_param[fqn]), sorted(expected_by_param[fqn])
        if have != want:
            problems.append(f"{fqn}: checkpoint has {have or 'nothing'}, this run expects {want or 'nothing'}")
    for key, value in expected.items():
        meta = saved_keys.get(key)
        if isinstance(meta, TensorStorageMetadata) and isinstance(value, torch.Tensor):
            if meta.properties.dtype != value.dtype:
                problems.append(f"{key}: saved as {meta.properties.dtype}, this run keeps {value.dtype}")
            elif tuple(meta.size) != tuple(value.shape):
                problems.append(f"{key}: saved with shape {tuple(meta.size)}, this run keeps {tuple(value.shape)}{_replica_hint(meta.size, value.shape)}")
    if problems:
        shown = "\n  ".join(problems[:8]) + (f"\n  ... and {len(problems) - 8} more" if len(problems) > 8 else "")
        raise CheckpointError(
            f"checkpoint {path} was written with a different optimizer setup than this run "
            "([optimizer] name, adamw_patterns / muon_patterns, a state dtype, or DeMo's replicas changed):\n  "
            f"{shown}\nRestore the old [optimizer] settings, or set [checkpoint] exclude_from_loading = "
            '["optimizer", "lr_scheduler"] in the TOML (the same list on the command line: comma-separated '
            "on torchtitan 0.2.2, space-separated on 0.3.0) to keep the weights and start the optimizer fresh."
        )


def _replica_hint(saved: tuple, current: tuple) -> str:
    """With [optimizer] demo = true Muon's momentum is saved per replica, (replicas, *shape)."""
    saved, current = tuple(saved), tuple(current)
    if len(saved) == len(current) and saved[1:] == current[1:]:
        return f" (with [optimizer] demo = true: momenta of {saved[0]} replicas, this run has {current[0]}; a new replica has no momentum of its own to resume)"
    if saved == current[1:] or saved[1:] == current:
        return " (saved with [optimizer] demo switched the other way: per-replica momenta vs one momentum)"
    return ""


def compare_model(saved: Metadata, expected: dict[str, Any], path: str) -> None:
    problems = []
    for key, value in expected.items():
        meta = saved.state_dict_metadata.get(key)
        if meta is None:
            problems.append(f"{key}: not in the checkpoint")
        elif isinstance(meta, TensorStorageMetadata) and meta.size != value.shape:  # DTensor: global shape
            problems.append(f"{key}: saved shape {tuple(meta.size)}, this model has {tuple(value.shape)}")
    if problems:
        raise CheckpointError(
            f"checkpoint {path} does not fit this model (another [model] flavor?):\n  " + "\n  ".join(problems[:8])
        )


def check_checkpoint(
    path: str, states: dict[str, Any], load_optimizer: bool, excluded: set[str], pipeline_stage: bool = False
) -> None:
    """Shards present and whole, model and (if loaded) optimizer state matching this run."""
    metadata = read_metadata(path)
    if "model" not in excluded:
        compare_model(metadata, states["model"].state_dict(), path)
    if load_optimizer and "optimizer" not in excluded:
        compare_optimizer_state(metadata, states["optimizer"].state_dict(), path, pipeline_stage)


def check_initial_load_path(path: str, checkpointer, checkpoint_config, pipeline_stage: bool = False) -> None:
    if not os.path.isdir(path):
        return  # torchtitan refuses it itself ("the path is not valid")
    if not os.path.isfile(os.path.join(path, ".metadata")):
        raise CheckpointError(
            f"checkpoint.initial_load_path {path} is not a complete DCP checkpoint: it has no .metadata "
            "file (an interrupted save or copy, or the parent folder instead of a step-N folder?)"
        )
    check_checkpoint(
        path,
        checkpointer.states,
        load_optimizer=not checkpoint_config.initial_load_model_only,
        excluded=set(checkpoint_config.exclude_from_loading),
        pipeline_stage=pipeline_stage,
    )


def check_before_resume(
    checkpointer, checkpoint_config, *, pipeline_stage: bool = False, initial_load_when_none_complete: bool = False
) -> None:
    """Run on every rank before ``checkpointer.load``; all ranks see the same files and act alike.
    ``pipeline_stage``: under pipeline parallel, where each rank holds one stage's parameters.

    Mirrors torchtitan's choice: the dump folder's newest complete checkpoint (or its
    ``load_step``), else ``checkpoint.initial_load_path``. When the dump folder exists but holds
    no complete checkpoint, torchtitan 0.2.2 ignores initial_load_path and starts from scratch
    (refused here), 0.3.0 loads initial_load_path (``initial_load_when_none_complete``).
    """
    if not checkpoint_config.enable:
        return
    folder, initial = checkpointer.folder, checkpoint_config.initial_load_path
    if not os.path.exists(folder):
        _check_initial(checkpointer, checkpoint_config, pipeline_stage)
        return
    found = checkpoint_to_resume(folder, checkpoint_config.load_step)
    if checkpoint_config.load_step == -1:
        skipped = interrupted_saves(folder, found[0] if found else None)
        if found is None and initial and not initial_load_when_none_complete:
            raise CheckpointError(
                f"{folder} exists but holds no complete checkpoint (incomplete: {skipped or 'none'}), so "
                f"torchtitan would ignore checkpoint.initial_load_path {initial} and start from scratch. "
                f"Delete {folder} to start again from {initial}."
            )
        if skipped:
            warn_skipped(skipped, found, initial if initial_load_when_none_complete else None)
        if found is None and initial_load_when_none_complete:
            _check_initial(checkpointer, checkpoint_config, pipeline_stage)
    if found is None:
        return
    step, path = found
    if step == 0 or not os.path.isfile(os.path.join(path, ".metadata")):
        return  # a model-only seed checkpoint, or a Hugging Face save: torchtitan handles those
    excluded = set(checkpoint_config.exclude_from_loading)
    check_checkpoint(path, checkpointer.states, load_optimizer=True, excluded=excluded, pipeline_stage=pipeline_stage)


def _check_initial(checkpointer, checkpoint_config, pipeline_stage: bool) -> None:
    initial = checkpoint_config.initial_load_path
    if initial and not checkpoint_config.initial_load_in_hf:
        check_initial_load_path(initial, checkpointer, checkpoint_config, pipeline_stage)


def checkpoint_io_error(error: CheckpointException, folder: str) -> CheckpointError:
    """One readable error for a DCP failure, which reaches every rank with all ranks' causes."""
    causes: dict[str, list[int]] = defaultdict(list)
    for rank, (cause, _traceback) in sorted(error.failures.items()):
        causes[f"{type(cause).__name__}: {cause}"].append(rank)
    listed = "\n  ".join(f"rank(s) {ranks}: {cause}" for cause, ranks in causes.items())
    resume = checkpoint_to_resume(folder, load_step=-1)
    kept = f"the newest complete one, {resume[1]}, is untouched" if resume else "there is no complete one yet"
    return CheckpointError(
        f"checkpoint I/O under {folder} failed:\n  {listed}\nCheckpoints already complete are not modified "
        f"({kept}). Fix the storage (space, permissions, --checkpoint.folder) and start the run again: "
        "it resumes from the newest complete checkpoint."
    )
