"""Multi-token-prediction layers taken out of a target checkpoint: DeepSeek-V3/GLM
(`model.layers.{L+k}.{enorm,hnorm,eh_proj,shared_head}`), Qwen3-Next (`mtp.*`), MiMo
(`model.mtp_layers.{k}.*`). Only the MTP tensors are read, so of a sharded target only their shards open.

Native names, per MTP layer k: `layers.{k}.token_norm`, `.hidden_norm`, `.input_proj`, `.final_norm`, the
decoder block under `.block.` with its source-relative names (MoE experts, FP8 scales and all), and the
embedding / LM head copies a DeepSeek layer stores. The target's config travels in `source_config`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from draftsmith.errors import DraftsmithError
from draftsmith.methods.formats.checkpoint import SourceCheckpoint
from draftsmith.methods.formats.registry import (
    Exported,
    NormalizedHead,
    ReadContext,
    provenance,
    register_exporter,
    register_source,
)
from draftsmith.models.head_configs import MTPConfig


@dataclass(frozen=True)
class Layout:
    name: str
    layer_prefix: str  # format() with L (target layers) and k (MTP layer)
    parts: dict[str, str]  # source name (relative to the layer prefix) -> native part name
    shared_prefix: str = ""  # Qwen3-Next: fc and norms outside the per-block prefix
    concat_order: str = "embedding_first"


LAYOUTS = {
    "deepseek": Layout("deepseek", "model.layers.{n}.", {
        "enorm.weight": "token_norm.weight", "hnorm.weight": "hidden_norm.weight", "eh_proj.weight": "input_proj.weight",
        "shared_head.norm.weight": "final_norm.weight", "shared_head.head.weight": "lm_head.weight",
        "embed_tokens.weight": "embed_tokens.weight"}),
    "qwen3_next": Layout("qwen3_next", "mtp.layers.{k}.", {
        "fc.weight": "input_proj.weight", "pre_fc_norm_embedding.weight": "token_norm.weight",
        "pre_fc_norm_hidden.weight": "hidden_norm.weight", "norm.weight": "final_norm.weight"}, shared_prefix="mtp."),
    "mimo": Layout("mimo", "model.mtp_layers.{k}.", {
        "token_layernorm.weight": "token_norm.weight", "hidden_layernorm.weight": "hidden_norm.weight",
        "input_proj.weight": "input_proj.weight", "final_layernorm.weight": "final_norm.weight"},
        concat_order="hidden_first"),
}
VLLM_CANNOT_SERVE_MIMO = (
    "vLLM cannot serve this export beside a {kind} target: it is written as MiMo's MTP, the only vLLM MTP model "
    "of a Llama-family block, and vLLM (0.32) reads MiMo MTP's layer count from the target's own config and "
    "transformers knows no `mimo` model type without MiMo's remote code. For vLLM, serve it with draftsmith, or "
    "train an EAGLE-3 head (recipes/eagle3-demo.yaml)")
REQUIRED_PARTS = ("token_norm.weight", "hidden_norm.weight", "input_proj.weight", "final_norm.weight")


def _mtp_count(config: dict) -> int:
    return int(config.get("num_nextn_predict_layers") or config.get("num_mtp_layers") or 0)


def _detect_layout(checkpoint: SourceCheckpoint) -> str | None:
    config, names = checkpoint.config, checkpoint.names
    layers = config.get("num_hidden_layers")
    if layers is not None and checkpoint.has(f"model.layers.{layers}.eh_proj.weight"):
        return "deepseek"
    if checkpoint.has("mtp.fc.weight"):
        return "qwen3_next"
    if any(n.startswith("model.mtp_layers.") for n in names):
        return "mimo"
    return None


def _layer_prefix(layout: Layout, layers: int, k: int) -> str:
    return layout.layer_prefix.format(n=layers + k, k=k)


@register_source("mtp", "MTP layers inside a target checkpoint (DeepSeek-V3/GLM, Qwen3-Next, MiMo layouts)")
class MTP:
    @staticmethod
    def detect(checkpoint: SourceCheckpoint) -> bool:
        return "draftsmith_head_type" not in checkpoint.config and _detect_layout(checkpoint) is not None

    @staticmethod
    def read(checkpoint: SourceCheckpoint, ctx: ReadContext) -> NormalizedHead:
        name = _detect_layout(checkpoint)
        if name is None:
            raise DraftsmithError(f"{checkpoint.path} holds no MTP layers in a layout draftsmith knows ({', '.join(LAYOUTS)})")
        layout, config = LAYOUTS[name], checkpoint.config
        layers = int(config["num_hidden_layers"])
        count = _mtp_count(config)
        if count < 1:
            raise DraftsmithError(f"{checkpoint.directory}/config.json: num_nextn_predict_layers must be >= 1 for MTP")
        tensors: dict[str, str] = {}  # native name -> source name
        shared = {}
        if layout.shared_prefix:  # fc and norms once, blocks under mtp.layers.{k}
            shared = {layout.shared_prefix + src: part for src, part in layout.parts.items()}
            for src, part in shared.items():
                tensors[f"layers.0.{part}"] = src
        for k in range(count):
            prefix = _layer_prefix(layout, layers, k)
            names = [n for n in checkpoint.names if n.startswith(prefix)]
            if not names:
                raise DraftsmithError(f"{checkpoint.path} has no tensors under {prefix} (MTP layer {k} of {count})")
            for src in names:
                relative = src.removeprefix(prefix)
                part = None if layout.shared_prefix else layout.parts.get(relative)
                tensors[f"layers.{k}.{part}" if part else f"layers.{k}.block.{relative}"] = src
        for k in range(1 if layout.shared_prefix else count):
            missing = [p for p in REQUIRED_PARTS if f"layers.{k}.{p}" not in tensors]
            if missing:
                raise DraftsmithError(f"MTP layer {k} lacks {', '.join(missing)} in {checkpoint.path}")
        read = checkpoint.read(list(tensors.values()))
        out = {native: read[src] for native, src in tensors.items()}
        config = _undo_mimo_block(config, out)
        hidden = int(config.get("hidden_size") or out["layers.0.input_proj.weight"].shape[0])
        vocab = int(config["vocab_size"])
        head = MTPConfig(layout=name, num_layers=count, hidden_size=hidden, vocab_size=vocab, target_num_layers=layers,
                         concat_order=layout.concat_order, shared_input_proj=bool(layout.shared_prefix),
                         target_model=(config.get("draftsmith") or {}).get("target_model") or ctx.target_name
                         or str(checkpoint.directory), source_config=_original_config(config))
        return NormalizedHead(head.to_json(), out, [f"{name} layout: {count} MTP layer(s), {len(out)} tensors read"])


# A Qwen2 block (MiMo's) is a Llama block with q/k/v biases: a Llama-family MTP layer exports as MiMo's layout,
# the one vLLM's mimo_mtp loads, with zero biases
QKV_BIASES = tuple(f"self_attn.{p}_proj.bias" for p in "qkv")


def _as_mimo_block(config: dict, tensors: dict[str, torch.Tensor], num_layers: int) -> None:
    """Rewrites a Llama-family MTP export in place into MiMo's block kind, recorded in the provenance block so
    that reading it back restores the original."""
    mark = config["draftsmith"]
    mark["zero_biases"] = []
    mark["source_block"] = {key: config.get(key) for key in ("model_type", "architectures", "attention_bias")}
    config.update(model_type="mimo", architectures=["MiMoForCausalLM"], attention_bias=True)
    for k in range(num_layers):
        prefix = LAYOUTS["mimo"].layer_prefix.format(k=k)
        for bias in QKV_BIASES:
            name = prefix + bias
            if name not in tensors:
                weight = tensors[name.removesuffix("bias") + "weight"]
                tensors[name] = torch.zeros(weight.shape[0], dtype=weight.dtype)
                mark["zero_biases"].append(f"layers.{k}.block.{bias}")


def _undo_mimo_block(config: dict, tensors: dict[str, torch.Tensor]) -> dict:
    """The inverse of `_as_mimo_block` (biases that are no longer zero keep the MiMo block)."""
    mark = config.get("draftsmith") or {}
    original, added = mark.get("source_block"), mark.get("zero_biases") or []
    if original is None or any(name not in tensors or tensors[name].any() for name in added):
        return config
    for name in added:
        del tensors[name]
    config = {**config, "draftsmith": {k: v for k, v in mark.items() if k not in ("zero_biases", "source_block")}}
    for key, value in original.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    return config


def _original_config(config: dict) -> dict:
    """The target's config as it was, undoing what an export changed (recorded in the provenance block)."""
    mark = config.get("draftsmith") or {}
    original = {k: v for k, v in config.items() if k != "draftsmith"}
    if "source_architectures" in mark:
        original["architectures"] = mark["source_architectures"]
    return original


def _source_names(c: MTPConfig) -> dict[str, str]:
    """Native name -> name in the target checkpoint, the inverse of `read`."""
    layout = LAYOUTS[c.layout]
    inverse = {part: src for src, part in layout.parts.items()}
    names = {}
    for k in range(c.num_layers):
        names[f"layers.{k}.block."] = _layer_prefix(layout, c.target_num_layers, k)
        if layout.shared_prefix:
            continue
        for part, src in inverse.items():
            names[f"layers.{k}.{part}"] = _layer_prefix(layout, c.target_num_layers, k) + src
    if layout.shared_prefix:
        for part, src in inverse.items():
            names[f"layers.0.{part}"] = layout.shared_prefix + src
    return names


def _to_source_layout(head: NormalizedHead, architectures: list[str] | None) -> Exported:
    c = MTPConfig.from_json(head.config)
    names = _source_names(c)
    tensors = {}
    for native, value in head.tensors.items():
        block = re.match(r"^(layers\.\d+\.block\.)(.*)$", native)
        tensors[names[block[1]] + block[2] if block else names[native]] = value
    config = dict(c.source_config)
    config.update(provenance(head))
    if architectures:
        config["draftsmith"]["source_architectures"] = config.get("architectures")
        config["architectures"] = architectures
    return Exported(config, tensors)


@register_exporter("vllm", "mtp")
def to_vllm(head: NormalizedHead) -> Exported:
    """A standalone checkpoint holding only the MTP tensors under their target names, with the target's config:
    what vLLM's deepseek_mtp / qwen3_next_mtp / mimo_mtp loaders read. An MTP layer draftsmith trained for a
    Llama-family target is written as MiMo's (vLLM has no MTP model of the Llama kind)."""
    exported = _to_source_layout(head, None)
    c = MTPConfig.from_json(head.config)
    if c.layout == "mimo" and c.source_config.get("model_type") != "mimo":
        block, kind = c.block_config(), c.source_config.get("model_type")
        # vLLM's Qwen2 layer: no q/k norms, no window in this layout, head_dim = hidden / heads
        lacks = [what for what, has in (("q/k norms", block.qk_norm), ("a sliding window", block.sliding_window),
                                        ("MLP biases", block.mlp_bias),
                                        ("a head_dim other than hidden / heads",
                                         block.head_dim * block.num_attention_heads != block.hidden_size)) if has]
        if lacks:
            raise DraftsmithError(f"vLLM has no MTP model for this {kind} block ({', '.join(lacks)}): MiMo's, the "
                                  "one a Llama-family block exports as, is a plain Qwen2 layer")
        _as_mimo_block(exported.config, exported.tensors, c.num_layers)
        exported.notes.append(VLLM_CANNOT_SERVE_MIMO.format(kind=kind))
    return exported


@register_exporter("sglang", "mtp")
def to_sglang(head: NormalizedHead) -> Exported:
    """SGLang's NextN draft (scripts/export_deepseek_nextn.py): layer keys unchanged, NextN architecture."""
    if head.config["layout"] != "deepseek":
        raise DraftsmithError(f"SGLang's standalone NextN export exists for DeepSeek-style MTP, not {head.config['layout']}")
    return _to_source_layout(head, ["DeepseekV3ForCausalLMNextN"])
