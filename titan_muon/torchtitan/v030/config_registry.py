"""Config functions for torchtitan 0.3.0: ``--module titan_muon.torchtitan.v030 --config NAME``.

    torchrun --nproc-per-node 2 -m torchtitan.train \\
        --module titan_muon.torchtitan.v030 --config llama3_gqa_muon --training.steps 50

(or ``-m titan_muon.torchtitan.v030.launch`` with the same flags). Each is the 0.3.0 twin of a
file in train_configs/: the same model, optimizer settings (MuonClip included), schedule and offline
data (the Python standard library, a BPE tokenizer trained
into ``hf_assets_path`` on first use). Every field is a command-line flag: ``--optimizer.ns_steps
3``, ``--optimizer.momentum_dtype bf16``, ``--dump_folder DIR``, ``--hf_assets_path DIR``,
``--dataloader.dataset text_files --dataloader.dataset_path DIR``. On CPU the settings of
titan_muon.torchtitan.v030.cpu are applied here already.
"""

from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
from torchtitan.components.optimizer import (
    LRSchedulersContainer,
    OptimizersContainer,
    default_adamw,
)
from torchtitan.config import DebugConfig, TrainingConfig
from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader
from torchtitan.models.common.config_utils import decoder_vocab_size

from titan_muon.torchtitan.v030 import cpu
from titan_muon.torchtitan.v030.data import OfflineTokenizer
from titan_muon.torchtitan.v030.metrics import MuonMetricsProcessor
from titan_muon.torchtitan.v030.models import model_spec
from titan_muon.torchtitan.v030.optimizer import MuonOptimizersContainer
from titan_muon.torchtitan.v030.trainer import MuonTrainer

ASSETS = "./outputs/assets/stdlib_bpe_2048"


def trainer_config(
    model_name: str, flavor: str, optimizer: OptimizersContainer.Config | None = None, dataset: str = "python_stdlib"
) -> MuonTrainer.Config:
    """A ``MuonTrainer.Config`` for a model of titan_muon.torchtitan.v030.models on the offline
    data, with torchtitan's defaults elsewhere (and on CPU the settings it needs there)."""
    spec = model_spec(model_name, flavor)
    vocab_size = decoder_vocab_size(spec)
    config = MuonTrainer.Config(
        model_spec=spec,
        hf_assets_path=ASSETS,
        loss=ChunkedLossWrapper.Config(loss_fn=CrossEntropyLoss.Config(global_vocab_size=vocab_size)),
        tokenizer=OfflineTokenizer.Config(dataset=dataset, vocab_size=vocab_size),
        dataloader=HuggingFaceTextDataLoader.Config(dataset=dataset),
        optimizer=optimizer if optimizer is not None else MuonOptimizersContainer.Config(),
        metrics=MuonMetricsProcessor.Config(),
    )
    if cpu.should_use_cpu():
        cpu.adapt_config(config)
    return config


def muon_settings(**changes) -> MuonOptimizersContainer.Config:
    """The [optimizer] section of train_configs/llama3_gqa_muon.toml."""
    settings = dict(lr=0.02, weight_decay=0.1, split="head", qk_clip=True, adamw_lr=0.003, beta1=0.9, beta2=0.95,
                    eps=1e-8)  # fmt: skip
    return MuonOptimizersContainer.Config(**{**settings, **changes})


def _debug_run(config: MuonTrainer.Config, dump_folder: str) -> MuonTrainer.Config:
    """The [training], [lr_scheduler], [metrics], [debug], [activation_checkpoint] and
    [checkpoint] sections shared by the files in train_configs/."""
    config.dump_folder = dump_folder
    config.lr_scheduler = LRSchedulersContainer.Config(warmup_steps=20)
    # CUDA graphs of forward + backward cannot hold Muon's backward overlap nor MuonClip's recording hooks
    # (MuonTrainer refuses those pairs)
    hooks = getattr(config.optimizer, "overlap", False) or getattr(config.optimizer, "qk_clip", False)
    config.training = TrainingConfig(
        local_batch_size=4, seq_len=256, steps=300, max_norm=1.0, mixed_precision_param="float32",
        disable_cuda_graphs=config.training.disable_cuda_graphs or hooks,
    )  # fmt: skip
    config.metrics.log_freq = 10
    config.metrics.enable_tensorboard = True
    config.debug = DebugConfig(seed=0)
    config.activation_checkpoint = None
    config.checkpoint = CheckpointManager.Config(enable=False)
    return config


def llama3_gqa_muon() -> MuonTrainer.Config:
    """train_configs/llama3_gqa_muon.toml: llama3 GQA debug model (8 query / 2 key-value heads), Muon."""
    return _debug_run(trainer_config("llama3", "debugmodel_gqa", muon_settings()), "./outputs/llama3_gqa_muon")


def llama3_gqa_adamw() -> MuonTrainer.Config:
    """train_configs/llama3_gqa_adamw.toml: the same model and data with torchtitan's AdamW."""
    return _debug_run(trainer_config("llama3", "debugmodel_gqa", default_adamw(lr=3e-3)), "./outputs/llama3_gqa_adamw")


def llama3_debugmodel_muon() -> MuonTrainer.Config:
    """torchtitan's own llama3 debugmodel (16 heads, fused Q/K/V) with Muon on the offline data."""
    return _debug_run(trainer_config("llama3", "debugmodel", muon_settings()), "./outputs/llama3_debugmodel_muon")


def mla_muon() -> MuonTrainer.Config:
    """train_configs/mla_muon.toml: multi-head latent attention, dense MLPs, Muon with fp8 momentum and
    backward overlap."""
    optimizer = muon_settings(momentum_dtype="fp8", overlap=True)
    return _debug_run(trainer_config("deepseek_v3", "debugmodel_dense", optimizer), "./outputs/mla_muon")


def moe_mla_muon() -> MuonTrainer.Config:
    """train_configs/moe_mla_muon.toml: MLA + MoE (8 routed experts, top 2, one shared expert, expert-bias
    load balancing), routed experts in Muon."""
    optimizer = muon_settings(momentum_dtype="fp8", overlap=True)
    return _debug_run(trainer_config("deepseek_v3", "debugmodel_moe", optimizer), "./outputs/moe_mla_muon")
