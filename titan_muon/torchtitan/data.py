"""Training data that needs no download: Python's own standard library sources.

Two pieces, both registered with torchtitan's own machinery:

* datasets ``python_stdlib`` / ``python_stdlib_validation``: every ``*.py`` file of the
  running interpreter's standard library (tests and site-packages excluded), one file per
  sample, in a fixed pseudo-random order (by SHA-1 of the relative path); 1 file in 20 is
  held out for validation. ``--training.dataset_path DIR`` reads another source tree the
  same way, and ``text_files`` takes ``*.txt`` / ``*.md`` files. They go into torchtitan's
  ``DATASETS`` registry, so its text dataloader (packing, sharding by rank, checkpointing
  of the position) is used unchanged.
* a byte-level BPE tokenizer trained on that corpus at first use and saved as a Hugging
  Face ``tokenizer.json`` under ``model.hf_assets_path``, which torchtitan's
  ``HuggingFaceTokenizer`` then loads like any downloaded tokenizer. Training is
  deterministic, and every rank checks that it holds the same tokenizer.
"""

import fcntl
import hashlib
import json
import os
import shutil
import sysconfig
import tempfile
from functools import partial
from pathlib import Path

import torch.distributed as dist
from datasets import Dataset, load_dataset
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from torchtitan.components.tokenizer import HuggingFaceTokenizer
from torchtitan.hf_datasets import DatasetConfig
from torchtitan.hf_datasets.text_datasets import DATASETS
from torchtitan.tools.logging import logger

STDLIB_DIR = sysconfig.get_paths()["stdlib"]
_SKIPPED_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__"}
_VALIDATION_ONE_IN = 20
BOS, EOS = "<|bos|>", "<|eos|>"


def _file_key(relative_path: str) -> int:
    return int.from_bytes(hashlib.sha1(relative_path.encode()).digest()[:8], "big")


def read_text_files(root: str, suffixes: tuple[str, ...], split: str) -> list[str]:
    """File contents under ``root`` in a fixed order; ``split`` is "train" or "validation"."""
    if not root:
        raise ValueError("this dataset needs --training.dataset_path (a directory)")
    root_path = Path(root)
    if not root_path.is_dir():
        raise FileNotFoundError(f"dataset directory {root!r} does not exist")
    keyed = []
    for directory, subdirectories, names in os.walk(root_path):
        subdirectories[:] = [d for d in subdirectories if d not in _SKIPPED_DIRS]
        for name in names:
            path = Path(directory, name)
            relative = path.relative_to(root_path).as_posix()
            key = _file_key(relative)
            if path.suffix in suffixes and (key % _VALIDATION_ONE_IN == 0) == (split == "validation"):
                keyed.append((key, relative, path))
    keyed.sort()
    texts = [path.read_bytes().decode("utf-8", errors="replace") for _, _, path in keyed]
    if not texts:
        raise ValueError(f"no {'/'.join(suffixes)} files found under {root!r} for split {split!r}")
    return texts


def _load_text_files(path: str, suffixes: tuple[str, ...], split: str) -> Dataset:
    return Dataset.from_dict({"text": read_text_files(path, suffixes, split)})


def _load_jsonl(path: str) -> Dataset:
    if not path:
        raise ValueError("the jsonl dataset needs --training.dataset_path (a .jsonl file)")
    return load_dataset("json", data_files=path, split="train")


def _text(sample: dict) -> str:
    return sample["text"]


PYTHON_FILES, TEXT_FILES = (".py",), (".txt", ".md")
# The datasets whose tokenizer can be trained on first use, and the files they read.
OFFLINE_DATASETS = {"python_stdlib": PYTHON_FILES, "text_files": TEXT_FILES}


def register_datasets() -> None:
    DATASETS["python_stdlib"] = DatasetConfig(
        path=STDLIB_DIR,
        loader=partial(_load_text_files, suffixes=PYTHON_FILES, split="train"),
        sample_processor=_text,
    )
    DATASETS["python_stdlib_validation"] = DatasetConfig(
        path=STDLIB_DIR,
        loader=partial(_load_text_files, suffixes=PYTHON_FILES, split="validation"),
        sample_processor=_text,
    )
    DATASETS["text_files"] = DatasetConfig(
        path="",  # set --training.dataset_path
        loader=partial(_load_text_files, suffixes=TEXT_FILES, split="train"),
        sample_processor=_text,
    )
    DATASETS["jsonl"] = DatasetConfig(
        path="",  # set --training.dataset_path to a .jsonl file with a "text" field
        loader=_load_jsonl,
        sample_processor=_text,
    )


def train_bpe_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def save_tokenizer(tokenizer: Tokenizer, directory: str) -> None:
    """Write ``directory`` atomically: readers see a complete tokenizer or none."""
    parent = os.path.dirname(os.path.abspath(directory))
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(dir=parent, prefix=".tokenizer-")
    tokenizer.save(os.path.join(staging, "tokenizer.json"))
    with open(os.path.join(staging, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": BOS, "eos_token": EOS}, f)
    try:
        os.rename(staging, directory)  # also replaces an empty placeholder directory
    except OSError:
        if not os.path.isfile(os.path.join(directory, "tokenizer.json")):
            raise
        shutil.rmtree(staging)  # another node on a shared file system was first


def ensure_offline_tokenizer(directory: str, corpus_dir: str, suffixes: tuple[str, ...], vocab_size: int) -> None:
    """Train the BPE tokenizer into ``directory`` unless one is there (torchtitan 0.2.x and 0.3.x)."""
    if os.path.isfile(os.path.join(directory, "tokenizer.json")):
        return
    os.makedirs(os.path.dirname(os.path.abspath(directory)), exist_ok=True)
    # Ranks of one machine start together: the first trains, the others wait and load.
    with open(os.path.abspath(directory) + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.isfile(os.path.join(directory, "tokenizer.json")):
            logger.info(f"Training a {vocab_size}-token BPE tokenizer on {corpus_dir} into {directory}")
            tokenizer = train_bpe_tokenizer(read_text_files(corpus_dir, suffixes, "train"), vocab_size)
            save_tokenizer(tokenizer, directory)


def check_same_tokenizer_on_all_ranks(directory: str) -> None:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    with open(os.path.join(directory, "tokenizer.json"), "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    digests = [None] * dist.get_world_size()
    dist.all_gather_object(digests, digest)
    if len(set(digests)) > 1:
        raise RuntimeError(
            f"ranks hold different tokenizers in {directory!r} (sha256 by rank: {digests}); "
            "nodes with different Python versions build different offline tokenizers: "
            "copy one tokenizer directory to every node"
        )


def build_tokenizer(job_config, vocab_size: int) -> HuggingFaceTokenizer:
    """torchtitan's Hugging Face tokenizer; for the offline datasets, built on first use."""
    # torchtitan 0.2.x only; titan_muon.torchtitan.v030.data has 0.3.0's offline tokenizer
    from torchtitan.components.tokenizer import build_hf_tokenizer

    directory = job_config.model.hf_assets_path
    dataset = job_config.training.dataset
    if dataset in OFFLINE_DATASETS:
        corpus_dir = job_config.training.dataset_path or DATASETS[dataset].path
        ensure_offline_tokenizer(directory, corpus_dir, OFFLINE_DATASETS[dataset], vocab_size)
        check_same_tokenizer_on_all_ranks(directory)
    tokenizer = build_hf_tokenizer(job_config)
    if tokenizer.get_vocab_size() > vocab_size:
        raise ValueError(
            f"the tokenizer in {directory!r} has {tokenizer.get_vocab_size()} tokens but the "
            f"model's vocab_size is {vocab_size}: point model.hf_assets_path at another directory"
        )
    return tokenizer
