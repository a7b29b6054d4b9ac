"""build_param_groups: every parameter by its role, on torchtitan 0.2.2 and 0.3.0 layouts; no silent guess."""

import copy
import logging

import pytest
import torch
from torch import nn
from torchtitan_layouts import V022Model, V030Model

from titan_muon import Muon, build_param_groups
from titan_muon.param_groups import classify

LOGGER = "titan_muon.param_groups"


def names_by_group(groups):
    return {("Muon" if g["use_muon"] else "AdamW"): set(g["param_names"]) for g in groups}


def linear_weights(model, exclude=("tok_embeddings", "output", "lm_head", "router")):
    return {
        f"{name}.weight" for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and not any(part in name.split(".") for part in exclude)
    }  # fmt: skip


def test_torchtitan_022_layout_every_matrix_and_expert_in_muon():
    model = V022Model()
    groups = names_by_group(build_param_groups(model))
    experts = {f"layers.{i}.moe.experts.{w}" for i in (1, 2) for w in ("w1", "w2", "w3")}
    assert groups["Muon"] == linear_weights(model) | experts
    assert {"tok_embeddings.weight", "output.weight", "norm.weight", "layers.1.moe.router.gate.weight"} <= groups["AdamW"]
    assert groups["Muon"] | groups["AdamW"] == {name for name, _ in model.named_parameters()}


def test_torchtitan_030_layout_every_matrix_and_expert_in_muon():
    model = V030Model()
    muon_group, adamw_group = build_param_groups(model)
    groups = names_by_group([muon_group, adamw_group])
    experts = {
        f"{layer}.moe.routed_experts.inner_experts.{w}"
        for layer in ("layers.1", "layers.2", "mtp_layers.0") for w in ("w1_EFD", "w2_EDF", "w3_EFD")
    }  # fmt: skip
    assert "layers.0.attention.qkv_linear.wqkv.weight" in groups["Muon"]
    assert "mtp_layers.0.eh_proj.weight" in groups["Muon"]
    assert "layers.1.moe.shared_experts.w2.weight" in groups["Muon"]
    assert groups["Muon"] == linear_weights(model) | experts
    assert groups["AdamW"] == {name for name, _ in model.named_parameters()} - groups["Muon"]
    assert {"lm_head.weight", "tok_embeddings.weight", "mtp_layers.0.enorm.weight", "layers.2.moe.router.gate.weight"} <= groups["AdamW"]
    # The 3-D expert stacks are orthogonalized one expert at a time: the optimizer takes them and steps.
    assert muon_group["matrix_stacks"] is True
    for p in model.parameters():
        nn.init.normal_(p, std=0.1)
        p.grad = torch.randn_like(p)
    Muon([muon_group, adamw_group], lr=0.01).step()


def test_roles_from_names_alone_and_from_module_types():
    def role(name, *shape, owner=None):
        return classify(name, nn.Parameter(torch.zeros(shape)), owner)

    assert role("layers.0.moe.routed_experts.inner_experts.w1_EFD", 4, 8, 16) == "expert stack"
    assert role("model.layers.0.mlp.experts.down_proj", 4, 16, 8) == "expert stack"  # Hugging Face fused experts
    assert role("layers.0.attention.qkv_linear.wqkv.weight", 48, 16) == "hidden matrix"
    assert role("layers.0.moe.router.gate.weight", 4, 16) == "router gate"
    assert role("layers.0.moe.shared_experts.gate.weight", 1, 16) == "router gate"  # qwen3.5's sigmoid gate
    assert role("layers.0.moe.routed_experts.inner_experts.mlp1_bias_EG", 4, 32) == "bias"  # gpt-oss: a 2-D bias stack
    assert role("vision_encoder.pos_embed", 64, 16) == "embedding"
    assert role("vision_encoder.patch_embed.weight", 16, 48) == "embedding"
    assert role("text_embedder.layers.0.w1.weight", 32, 16) == "hidden matrix"
    assert role("lm_head.weight", 50, 16) == "output head"
    assert role("layers.0.attention.sinks", 4) == "vector"
    assert role("layers.0.attn.conv_q.weight", 16, 1, 4) == "convolution"
    assert role("_orig_mod.layers.0._checkpoint_wrapped_module.attention.wo.weight", 16, 16) == "hidden matrix"
    # A module's type decides what its name cannot.
    assert role("table.weight", 50, 16, owner=nn.Embedding(50, 16)) == "embedding"
    assert role("mixer.weight", 16, 16, 3, owner=nn.Conv1d(16, 16, 3)) == "convolution"
    # What no rule fits.
    assert role("layers.0.moe.blocks.w1_EFD", 4, 8, 16) == "unclassified"  # 3-D outside an experts module
    assert role("layers.0.proj", 16, 16) == "unclassified"  # a bare 2-D nn.Parameter
    assert role("layers.0.wq", 16, 16) == "hidden matrix"  # ... unless named like a projection
    assert role("layers.0.w1", 4, 16, 16) == "unclassified"  # not a stack of experts


class _Unusual(nn.Module):
    """torchtitan-like layers whose expert stacks sit in a module no rule knows."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleDict({str(i): nn.Module() for i in range(2)})
        for layer in self.layers.values():
            layer.mlp = nn.Linear(16, 16, bias=False)
            layer.blocks = nn.Module()
            layer.blocks.w1_EFD = nn.Parameter(torch.randn(4, 8, 16))
        self.scale = nn.Parameter(torch.ones(16, 16))


def test_unclassified_parameter_raises_naming_it_and_the_opt_out():
    with pytest.raises(ValueError) as error:
        build_param_groups(_Unusual())
    message = str(error.value)
    assert "layers.*.blocks.w1_EFD (4, 8, 16) x2" in message
    assert "scale (16, 16) x1" in message
    assert 'unclassified="adamw"' in message and "muon_patterns" in message
    assert "layers.0.mlp.weight" not in message
    with pytest.raises(ValueError, match="unclassified='muon'"):
        build_param_groups(_Unusual(), unclassified="muon")


def test_opt_out_sends_unclassified_to_adamw_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        groups = names_by_group(build_param_groups(_Unusual(), unclassified="adamw"))
    assert groups["AdamW"] == {"layers.0.blocks.w1_EFD", "layers.1.blocks.w1_EFD", "scale"}
    assert groups["Muon"] == {"layers.0.mlp.weight", "layers.1.mlp.weight"}
    (warning,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert "layers.*.blocks.w1_EFD" in warning.getMessage() and "scale" in warning.getMessage()
    # Patterns place them instead, with no warning.
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        groups = names_by_group(build_param_groups(_Unusual(), muon_patterns=["*.blocks.*"], adamw_patterns=["scale"]))
    assert groups["Muon"] == {"layers.0.mlp.weight", "layers.1.mlp.weight", "layers.0.blocks.w1_EFD", "layers.1.blocks.w1_EFD"}
    assert not caplog.records


def test_the_assignment_is_logged_as_one_table(caplog):
    with caplog.at_level(logging.INFO, logger=LOGGER):
        build_param_groups(V030Model())
    (record,) = [r for r in caplog.records if r.name == LOGGER]
    assert record.levelno == logging.INFO
    rows = [line.split() for line in record.getMessage().splitlines()[1:]]
    assert rows[0] == ["group", "role", "shape", "count", "parameter"]
    table = {row[-1]: row for row in rows[1:]}
    assert table["layers.*.moe.routed_experts.inner_experts.w1_EFD"] == ["Muon", "expert", "stack", "4x32x16", "2", "layers.*.moe.routed_experts.inner_experts.w1_EFD"]
    assert table["layers.*.attention.qkv_linear.wqkv.weight"][:4] == ["Muon", "hidden", "matrix", "32x16"]
    assert table["lm_head.weight"] == ["AdamW", "output", "head", "50x16", "1", "lm_head.weight"]
    assert table["layers.*.moe.router.gate.weight"][:3] == ["AdamW", "router", "gate"]
    # Every parameter is counted once.
    assert sum(int(row[-2]) for row in rows[1:]) == len(list(V030Model().parameters()))


@pytest.mark.parametrize("name", ["llama3", "llama4", "deepseek_v3", "qwen3", "gpt_oss"])
def test_torchtitan_022_models_classify_without_unclassified_parameters(name):
    """The installed torchtitan's own debug models, on meta: nothing unknown, experts in Muon."""
    import importlib

    from torchtitan.config import JobConfig
    from torchtitan.protocols.train_spec import get_train_spec

    importlib.import_module(f"torchtitan.models.{name}")
    spec = get_train_spec(name)
    args = copy.deepcopy(spec.model_args["debugmodel"])
    if hasattr(args, "update_from_config"):
        args.update_from_config(JobConfig())
    with torch.device("meta"):
        model = spec.model_cls(args)
    groups = names_by_group(build_param_groups(model))
    three_d = {n for n, p in model.named_parameters() if p.ndim == 3}
    assert three_d <= groups["Muon"]
    assert not any(".router." in n or "embeddings" in n or n.startswith("output.") for n in groups["Muon"])
