"""The train specs ``titan_muon_llama3`` and ``titan_muon_mla``.

Each is torchtitan's own spec (``llama3``, ``deepseek_v3``) with six swaps: our optimizer
builder, our metrics processor, the offline tokenizer, a few extra small model flavors,
under pipeline parallel a loss whose gradient is normalized (pipeline.py), and with
``[optimizer] demo = true`` FSDP2 on each replica's shard mesh only (replicas.py).
``titan_muon_mla`` keeps torchtitan's MoE expert-bias load balancing for every optimizer,
Muon included.
Select one with ``[model] name = "titan_muon_llama3"`` and
``[experimental] custom_import = "titan_muon.torchtitan"``.
"""

import dataclasses
from collections.abc import Mapping

from torchtitan.models.deepseek_v3 import DeepSeekV3ModelArgs
from torchtitan.models.llama3 import TransformerModelArgs
from torchtitan.models.moe import MoEArgs
from torchtitan.protocols.train_spec import TrainSpec, get_train_spec, register_train_spec

from titan_muon.torchtitan.data import build_tokenizer
from titan_muon.torchtitan.metrics import build_metrics_processor
from titan_muon.torchtitan.replicas import parallelize_for_demo
from titan_muon.torchtitan.v022.optimizer import build_optimizers, build_optimizers_with_moe_load_balancing
from titan_muon.torchtitan.v022.pipeline import pipeline_loss_builder

LLAMA3_FLAVORS = {
    # Grouped-query attention: 8 query heads share 2 key/value heads.
    "debugmodel_gqa": TransformerModelArgs(
        dim=256, n_layers=4, n_heads=8, n_kv_heads=2, vocab_size=2048, rope_theta=500000
    ),
    "tiny_gqa": TransformerModelArgs(  # for tests
        dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=2048, multiple_of=64, rope_theta=500000
    ),
}

# DeepSeek-V3's MoE layer: sigmoid router scores normalized over the top k, one shared
# expert, auxiliary-loss-free load balancing (expert biases). On CPU see cpu.py.
def _moe(num_experts: int) -> MoEArgs:
    return MoEArgs(num_experts=num_experts, num_shared_experts=1, top_k=2, score_func="sigmoid", route_norm=True)


# Multi-head latent attention (DeepSeek-V3): *_dense flavors use dense MLPs in every layer
# (n_dense_layers = n_layers), *_moe flavors one dense layer and then MoE layers.
MLA_FLAVORS = {
    "debugmodel_dense": DeepSeekV3ModelArgs(
        vocab_size=2048, dim=256, inter_dim=768, n_layers=3, n_dense_layers=3, n_heads=8,
        q_lora_rank=128, kv_lora_rank=128, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
    ),
    "tiny_dense": DeepSeekV3ModelArgs(  # for tests
        vocab_size=2048, dim=64, inter_dim=128, n_layers=2, n_dense_layers=2, n_heads=4,
        q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
    ),
    "debugmodel_moe": DeepSeekV3ModelArgs(
        vocab_size=2048, dim=256, inter_dim=768, moe_inter_dim=192, n_layers=3, n_dense_layers=1, n_heads=8,
        q_lora_rank=128, kv_lora_rank=128, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
        moe_args=_moe(8),
    ),
    "tiny_moe": DeepSeekV3ModelArgs(  # for tests: 6 experts split unevenly over 4 ranks
        vocab_size=2048, dim=64, inter_dim=128, moe_inter_dim=32, n_layers=2, n_dense_layers=1, n_heads=4,
        q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        moe_args=_moe(6),
    ),
}  # fmt: skip


def _tokenizer_for(model_args: Mapping):
    def build(job_config):
        return build_tokenizer(job_config, vocab_size=model_args[job_config.model.flavor].vocab_size)

    return build


def _with_titan_muon(base: TrainSpec, extra_flavors: dict, build_optimizers_fn) -> TrainSpec:
    model_args = {**base.model_args, **extra_flavors}
    return dataclasses.replace(
        base,
        model_args=model_args,
        build_optimizers_fn=build_optimizers_fn,
        build_tokenizer_fn=_tokenizer_for(model_args),
        build_metrics_processor_fn=build_metrics_processor,
        build_loss_fn=pipeline_loss_builder(base.build_loss_fn),
        parallelize_fn=parallelize_for_demo(base.parallelize_fn),
    )


def register_train_specs() -> None:
    register_train_spec("titan_muon_llama3", _with_titan_muon(get_train_spec("llama3"), LLAMA3_FLAVORS, build_optimizers))
    mla = _with_titan_muon(get_train_spec("deepseek_v3"), MLA_FLAVORS, build_optimizers_with_moe_load_balancing)
    register_train_spec("titan_muon_mla", mla)
