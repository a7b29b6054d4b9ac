"""One attention-layer finder (titan_muon.attention.layers) for Muon Split, QK-clip and max-logit recording.

The models are torchtitan 0.2.2's own llama3 and deepseek_v3 debug models (built on the meta
device: only names and shapes are read) and a stand-in for 0.3.0's fused ``qkv_linear.wqkv``.
The expected descriptions are written from the models' arguments, not from the finder; the
agreement tests check that Split's row blocks, QK-clip's layers and the recorder's hooks all
name exactly the layers and projections the finder reports.
"""

import ast
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    checkpoint_wrapper,
)
from torchtitan.models.deepseek_v3 import deepseekv3_args
from torchtitan.models.deepseek_v3.model.model import DeepSeekV3Model
from torchtitan.models.llama3 import llama3_args
from torchtitan.models.llama3.model.model import Transformer
from torchtitan_layouts import V030Attention, V030Model

import titan_muon
from titan_muon.attention.clip import QKClip
from titan_muon.attention.layers import describe_attention, find_attention_layers
from titan_muon.attention.logits import MaxLogitRecorder
from titan_muon.attention.split import attention_row_blocks


def llama3_debug(n_kv_heads=None):
    args = dataclasses.replace(llama3_args["debugmodel"], n_kv_heads=n_kv_heads)
    with torch.device("meta"):
        return Transformer(args), args


def deepseek_v3_debug(q_lora_rank=0):
    args = dataclasses.replace(deepseekv3_args["debugmodel"], q_lora_rank=q_lora_rank)
    args.moe_impl = "standard"  # set by update_from_config in a torchtitan run
    with torch.device("meta"):
        return DeepSeekV3Model(args), args


def expected_llama3(args):
    """What the debug model's arguments say each layer is: MHA when n_kv_heads is None."""
    kv_heads = args.n_kv_heads or args.n_heads
    head_dim = args.dim // args.n_heads
    return {
        "kind": "mha" if kv_heads == args.n_heads else "gqa",
        "n_heads": args.n_heads,
        "n_kv_heads": kv_heads,
        "qk_head_dim": head_dim,
        "v_head_dim": head_dim,
        "projections": ("wq", "wk", "wv"),
    }


def expected_mla(args):
    return {
        "kind": "mla",
        "n_heads": args.n_heads,
        "n_kv_heads": args.n_heads,
        "qk_head_dim": args.qk_nope_head_dim + args.qk_rope_head_dim,
        "v_head_dim": args.v_head_dim,
        "projections": ("wq_b" if args.q_lora_rank else "wq", "wkv_b", "wkv_b"),
    }


def described(layer):
    return {
        "kind": layer.kind,
        "n_heads": layer.n_heads,
        "n_kv_heads": layer.n_kv_heads,
        "qk_head_dim": layer.qk_head_dim,
        "v_head_dim": layer.v_head_dim,
        "projections": (layer.query_projection_name, layer.key_projection_name, layer.value_projection_name),
    }


CASES = {
    "llama3_debug_mha": lambda: (*llama3_debug(), expected_llama3),
    "llama3_debug_gqa": lambda: (*llama3_debug(n_kv_heads=4), expected_llama3),
    "deepseek_v3_debug_mla": lambda: (*deepseek_v3_debug(), expected_mla),
    "deepseek_v3_debug_mla_q_lora": lambda: (*deepseek_v3_debug(q_lora_rank=32), expected_mla),
}


@pytest.mark.parametrize("case", CASES)
def test_the_finder_describes_torchtitan_022_debug_models(case):
    model, args, expected = CASES[case]()
    layers = find_attention_layers(model)
    assert [layer.path for layer in layers] == [f"layers.{i}.attention" for i in range(args.n_layers)]
    for layer in layers:
        assert described(layer) == expected(args)
        assert layer.module is model.get_submodule(layer.path)
    if case.startswith("deepseek"):
        assert (layers[0].qk_nope_head_dim, layers[0].qk_rope_head_dim) == (args.qk_nope_head_dim, args.qk_rope_head_dim)


def test_the_finder_describes_torchtitan_030_fused_wqkv():
    layer = describe_attention(V030Attention(16, 6, 2, 4), "attention")
    assert (layer.kind, layer.n_heads, layer.n_kv_heads, layer.heads_per_kv, layer.qk_head_dim) == ("fused_wqkv", 6, 2, 3, 4)
    assert layer.projection_names() == ["qkv_linear.wqkv"]
    assert layer.fused_layout.rows == (6 + 2 * 2) * 4
    separate = describe_attention(V030Attention(16, 6, 2, 4, fused=False))
    assert (separate.kind, separate.projection_names()) == ("gqa", ["qkv_linear.wq", "qkv_linear.wk", "qkv_linear.wv"])


def split_clip_and_recorder_agree(model):
    """Split, QK-clip and the recorder see the finder's layers, and name the same projections."""
    layers = find_attention_layers(model)
    assert layers, "the model has attention layers"
    expected_blocks = {layer.weight_fqn(name) for layer in layers for name in layer.projection_names()}
    blocks = attention_row_blocks(model)
    assert set(blocks) == expected_blocks
    assert expected_blocks <= {name for name, _ in model.named_parameters()}  # real parameter FQNs
    qk_clip = QKClip(model)
    try:
        assert [(layer.name, layer.kind, layer.module) for layer in qk_clip.layers] == [
            (layer.name, layer.kind, layer.module) for layer in layers
        ]
        assert qk_clip.recorder.layers == [layer.module for layer in layers]
        assert qk_clip.recorder.heads == [layer.n_heads for layer in layers]
        # The projections QK-clip scales are the ones Split cuts (the MLA value rows share wkv_b with k_nope).
        for layer in qk_clip.layers:
            for role in ("query_projection", "key_projection"):
                fqn = layer.weight_fqn(getattr(layer, f"{role}_name"))
                assert fqn in blocks and model.get_parameter(fqn) is getattr(layer, role).weight
    finally:
        qk_clip.remove()
    recorder = MaxLogitRecorder.attach(model)
    assert recorder.layers == [layer.module for layer in layers]
    recorder.remove()


@pytest.mark.parametrize("case", CASES)
def test_split_clip_and_recorder_agree_on_torchtitan_022_debug_models(case):
    model, _, _ = CASES[case]()
    split_clip_and_recorder_agree(model)


def test_split_clip_and_recorder_agree_on_torchtitan_030_fused_wqkv():
    split_clip_and_recorder_agree(V030Model())


def test_wrapped_layers_keep_parameter_fqns_for_split_and_clean_names_for_clip():
    model, _ = llama3_debug(n_kv_heads=4)
    for index, block in list(model.layers.items()):
        model.layers[index] = checkpoint_wrapper(block)
    layers = find_attention_layers(model)
    assert layers[0].path == "layers.0._checkpoint_wrapped_module.attention"
    assert layers[0].name == "layers.0.attention"
    split_clip_and_recorder_agree(model)


def test_an_unknown_attention_layout_is_named():
    class Unknown(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner_attention = nn.Identity()
            self.qkv = nn.Linear(4, 12)

    model = nn.ModuleDict({"block": nn.ModuleDict({"attn": Unknown()})})
    with pytest.raises(ValueError, match="'block.attn' \\(Unknown\\) is none of the layouts"):
        find_attention_layers(model)
    with pytest.raises(ValueError, match="'block.attn'"):
        attention_row_blocks(model)


FINDER_USERS = ("attention.layers", "attention.logits", "attention.clip", "attention.split")


def titan_muon_imports(module_name):
    """(module-level imports, imports inside functions or classes) of titan_muon modules in a titan_muon file."""
    tree = ast.parse(Path(titan_muon.__file__).parent.joinpath(*module_name.split(".")).with_suffix(".py").read_text())
    top_level = {id(node) for node in tree.body}
    found = {True: set(), False: set()}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("titan_muon"):
            found[id(node) in top_level].add(node.module)
        elif isinstance(node, ast.Import):
            found[id(node) in top_level].update(a.name for a in node.names if a.name.startswith("titan_muon"))
    return found[True], found[False]


def test_the_finder_and_its_users_import_each_other_one_way_only():
    """No function-local import hides a cycle; the recorder and Split never import the clip."""
    graph = {}
    for name in FINDER_USERS:
        module_level, local = titan_muon_imports(name)
        assert not local, f"titan_muon/{name.replace('.', '/')}.py imports {local} inside a function"
        graph[name] = {m.removeprefix("titan_muon.") for m in module_level} & set(FINDER_USERS)
    assert graph == {"attention.layers": set(), "attention.logits": {"attention.layers"},
                     "attention.clip": {"attention.layers", "attention.logits"},
                     "attention.split": {"attention.layers"}}  # fmt: skip
    code = "import sys, titan_muon.attention.logits, titan_muon.attention.split; assert 'titan_muon.attention.clip' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
