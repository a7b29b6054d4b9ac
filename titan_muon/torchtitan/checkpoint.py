"""Check the checkpoint a run is about to resume from, before torchtitan loads it.

torchtitan 0.2.2 resumes from the newest ``step-N`` folder that has a ``.metadata`` file:
a save interrupted before writing it is skipped without a word (a silent restart from an
older step, or from scratch), a truncated shard fails deep inside DCP, and a checkpoint
written under another optimizer setup fails with a bare "Missing key". This module reads
only the DCP metadata and the file sizes, and raises one error that names the folder,
what is wrong and what to do. Bit flips inside a shard cannot be seen: DCP stores no
checksums.
"""

import os
import re
from collections import defaultdict
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

_STEP_DIR = re.compile(r"step-(\d+)$")


class CheckpointError(RuntimeError):
    pass


def checkpoint_to_resume(folder: str, load_step: int) -> tuple[int, str] | None:
    """``(step, path)`` of the folder torchtitan will load, refusing incomplete newer ones."""
    if not os.path.isdir(folder):
        return None
    steps = {int(m.group(1)): os.path.join(folder, name) for name in os.listdir(folder) if (m := _STEP_DIR.match(name))}
    complete = [step for step, path in steps.items() if os.path.isfile(os.path.join(path, ".metadata"))]
    if load_step != -1:
        if load_step not in steps:
            return None  # torchtitan reports the missing folder itself
        if load_step not in complete:
            raise CheckpointError(f"checkpoint {steps[load_step]} is incomplete: it has no .metadata file")
        return load_step, steps[load_step]
    newest_complete = max(complete, default=-1)
    newer_incomplete = sorted(step for step in steps if step > newest_complete)
    if newer_incomplete:
        older = f"step-{newest_complete}" if newest_complete >= 0 else "scratch"
        raise CheckpointError(
            f"checkpoint {steps[newer_incomplete[-1]]} is incomplete (no .metadata: was the save "
            f"interrupted?). Resuming would silently restart from {older}. Delete the incomplete "
            f"folder(s) {[f'step-{s}' for s in newer_incomplete]} to accept that, or pass "
            "--checkpoint.load_step to choose a step."
        )
    return (newest_complete, steps[newest_complete]) if complete else None


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


def compare_optimizer_state(saved: Metadata, expected: dict[str, Any], path: str) -> None:
    """Raise if the saved per-parameter optimizer state differs from what this run builds."""
    saved_keys = {
        key.removeprefix("optimizer."): meta
        for key, meta in saved.state_dict_metadata.items()
        if key.startswith("optimizer.state.")
    }
    if not saved_keys:
        raise CheckpointError(
            f"checkpoint {path} holds no optimizer state (saved with last_save_model_only?). To start "
            "from its weights with a fresh optimizer pass --checkpoint.exclude_from_loading "
            "optimizer,lr_scheduler,dataloader,train_state"
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
    for fqn in sorted(set(saved_by_param) | set(expected_by_param)):
        have, want = sorted(saved_by_param[fqn]), sorted(expected_by_param[fqn])
        if have != want:
            problems.append(f"{fqn}: checkpoint has {have or 'nothing'}, this run expects {want or 'nothing'}")
    for key, value in expected.items():
        meta = saved_keys.get(key)
        if isinstance(meta, TensorStorageMetadata) and isinstance(value, torch.Tensor):
            if meta.properties.dtype != value.dtype:
                problems.append(f"{key}: saved as {meta.properties.dtype}, this run keeps {value.dtype}")
    if problems:
        shown = "\n  ".join(problems[:8]) + (f"\n  ... and {len(problems) - 8} more" if len(problems) > 8 else "")
        raise CheckpointError(
            f"checkpoint {path} was written with a different optimizer setup than this run "
            "([optimizer] name, adamw_patterns / muon_patterns, or a state dtype changed):\n  "
            f"{shown}\nRestore the old [optimizer] settings, or pass --checkpoint.exclude_from_loading "
            "optimizer,lr_scheduler to keep the weights and start the optimizer fresh."
        )


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


def check_before_resume(checkpointer, checkpoint_config) -> None:
    """Run on every rank before ``checkpointer.load``; all ranks see the same files and fail alike."""
    if not checkpoint_config.enable:
        return
    found = checkpoint_to_resume(checkpointer.folder, checkpoint_config.load_step)
    if found is None:
        return
    step, path = found
    if step == 0:  # a model-only seed checkpoint; torchtitan loads just the model
        return
    metadata = read_metadata(path)
    excluded = set(checkpoint_config.exclude_from_loading)
    if "model" not in excluded:
        compare_model(metadata, checkpointer.states["model"].state_dict(), path)
    if "optimizer" not in excluded:
        compare_optimizer_state(metadata, checkpointer.states["optimizer"].state_dict(), path)
