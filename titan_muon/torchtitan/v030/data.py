"""Offline training data for torchtitan 0.3.0: the datasets and tokenizer of titan_muon.torchtitan.data.

The datasets (``python_stdlib``, ``python_stdlib_validation``, ``text_files``, ``jsonl``) go into
torchtitan's ``DATASETS`` registry, which 0.3.0's ``HuggingFaceTextDataLoader`` still reads:
:func:`register_datasets` (called when this module is imported). The tokenizer is a
``HuggingFaceTokenizer`` whose ``Config`` names the corpus: :class:`OfflineTokenizer` trains the
byte-level BPE into ``hf_assets_path`` on first use (as 0.2.2's ``build_tokenizer`` does),
checks that every rank holds the same one, then loads it like any downloaded tokenizer.
"""

from dataclasses import dataclass

from torchtitan.components.tokenizer import HuggingFaceTokenizer
from torchtitan.hf_datasets.text_datasets import DATASETS

from titan_muon.torchtitan import data

register_datasets = data.register_datasets
register_datasets()


class OfflineTokenizer(HuggingFaceTokenizer):
    """torchtitan's Hugging Face tokenizer, trained on the offline corpus if the directory has none."""

    @dataclass(kw_only=True, slots=True)
    class Config(HuggingFaceTokenizer.Config):
        dataset: str = "python_stdlib"
        """The dataset whose files train the tokenizer (python_stdlib, text_files); another name
        means a downloaded tokenizer must already be in hf_assets_path."""

        dataset_path: str | None = None
        """The corpus directory; unset: the dataset's own (the running Python's standard library)."""

        vocab_size: int = 2048
        """Tokens of the trained tokenizer; at most the model's vocab_size."""

    def __init__(self, config: Config | None = None, *, tokenizer_path: str) -> None:
        config = config or OfflineTokenizer.Config()
        if config.dataset in data.OFFLINE_DATASETS:
            corpus_dir = config.dataset_path or DATASETS[config.dataset].path
            suffixes = data.OFFLINE_DATASETS[config.dataset]
            data.ensure_offline_tokenizer(tokenizer_path, corpus_dir, suffixes, config.vocab_size)
            data.check_same_tokenizer_on_all_ranks(tokenizer_path)
        super().__init__(config, tokenizer_path=tokenizer_path)
        if self.get_vocab_size() > config.vocab_size:
            raise ValueError(
                f"the tokenizer in {tokenizer_path!r} has {self.get_vocab_size()} tokens, more than "
                f"tokenizer.vocab_size = {config.vocab_size}: point hf_assets_path at another directory"
            )
