"""Tiny checkpoints in the exact public layouts of docs/formats.md (key names, shapes, file types, config
keys), random values, sized to the demo model (hidden 256, 6 layers, vocab 8192) so converted heads can
decode against it. Built here from the format description, never through draftsmith's own exporters.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

H, FFN, NH, NKV, HD, V, L = 256, 768, 4, 2, 64, 8192, 6  # the demo model's shapes

LLAMA_LAYER_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": H,
                      "intermediate_size": FFN, "num_attention_heads": NH, "num_key_value_heads": NKV,
                      "num_hidden_layers": 1, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
                      "max_position_embeddings": 2048, "vocab_size": V, "pad_token_id": 0, "torch_dtype": "float16",
                      "tie_word_embeddings": False}


def _w(*shape, dtype=torch.float32):
    return (torch.randn(*shape) * 0.05).to(dtype)


def _norm(dim, dtype=torch.float32):
    return (1 + 0.1 * torch.randn(dim)).to(dtype)


def _write(directory: Path, config: dict | None, tensors: dict, weights: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    if config is not None:
        (directory / "config.json").write_text(json.dumps(config, indent=2))
    if weights.endswith(".safetensors"):
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(directory / weights))
    else:
        torch.save(tensors, directory / weights)
    return directory


def attention(prefix: str, in_dim: int, bias: bool = False, dtype=torch.float32) -> dict:
    t = {f"{prefix}self_attn.q_proj.weight": _w(NH * HD, in_dim, dtype=dtype),
         f"{prefix}self_attn.k_proj.weight": _w(NKV * HD, in_dim, dtype=dtype),
         f"{prefix}self_attn.v_proj.weight": _w(NKV * HD, in_dim, dtype=dtype),
         f"{prefix}self_attn.o_proj.weight": _w(H, NH * HD, dtype=dtype)}
    if bias:
        t |= {f"{prefix}self_attn.q_proj.bias": _w(NH * HD, dtype=dtype),
              f"{prefix}self_attn.k_proj.bias": _w(NKV * HD, dtype=dtype),
              f"{prefix}self_attn.v_proj.bias": _w(NKV * HD, dtype=dtype)}
    return t


def mlp(prefix: str, dtype=torch.float32, hidden: int = H) -> dict:
    return {f"{prefix}mlp.gate_proj.weight": _w(FFN, hidden, dtype=dtype), f"{prefix}mlp.up_proj.weight": _w(FFN, hidden, dtype=dtype),
            f"{prefix}mlp.down_proj.weight": _w(hidden, FFN, dtype=dtype)}


def yuhuili_eagle(directory: Path, fc_bias: bool = True, embed: bool = True, qwen2: bool = False,
                  weights: str = "pytorch_model.bin") -> Path:
    """yuhuili EAGLE-1: fp32 .bin with the frozen embedding, no input_layernorm/norm/lm_head (section 1.2)."""
    torch.manual_seed(11)
    t = {"fc.weight": _w(H, 2 * H)}
    if fc_bias:
        t["fc.bias"] = _w(H)
    t |= attention("layers.0.", H, bias=qwen2) | mlp("layers.0.")
    t["layers.0.post_attention_layernorm.weight"] = _norm(H)
    if embed:
        t["embed_tokens.weight"] = _w(V, H)
    config = dict(LLAMA_LAYER_CONFIG, bias=fc_bias)
    if qwen2:
        config.update(model_type="qwen2", architectures=["Qwen2ForCausalLM"])
        config.pop("bias")
    return _write(directory, config, t, weights)


def eagle3_tensors(prefix: str = "midlayer.", draft_vocab: int = 2048, dtype=torch.float16, hidden: int = H,
                   target_hidden: int = H) -> dict:
    """EAGLE-3 tensors with yuhuili names (section 2.2); d2t/t2d pick every 4th target id."""
    used = torch.arange(0, 4 * draft_vocab, 4)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[used] = True
    nh_dim, kv_dim = NH * HD, NKV * HD
    t = {f"{prefix}self_attn.q_proj.weight": _w(nh_dim, 2 * hidden, dtype=dtype),
         f"{prefix}self_attn.k_proj.weight": _w(kv_dim, 2 * hidden, dtype=dtype),
         f"{prefix}self_attn.v_proj.weight": _w(kv_dim, 2 * hidden, dtype=dtype),
         f"{prefix}self_attn.o_proj.weight": _w(hidden, nh_dim, dtype=dtype),
         **mlp(prefix, dtype, hidden),
         f"{prefix}input_layernorm.weight": _norm(hidden, dtype), f"{prefix}hidden_norm.weight": _norm(hidden, dtype),
         f"{prefix}post_attention_layernorm.weight": _norm(hidden, dtype),
         "fc.weight": _w(hidden, 3 * target_hidden, dtype=dtype), "norm.weight": _norm(hidden, dtype),
         "lm_head.weight": _w(draft_vocab, hidden, dtype=dtype),
         "d2t": used - torch.arange(draft_vocab), "t2d": t2d}
    return t


def yuhuili_eagle3(directory: Path, draft_vocab: int = 2048) -> Path:
    """yuhuili EAGLE-3: fp16 .bin without the embedding, config with draft_vocab_size, no layer ids."""
    torch.manual_seed(12)
    config = dict(LLAMA_LAYER_CONFIG, draft_vocab_size=draft_vocab)
    return _write(directory, config, eagle3_tensors(draft_vocab=draft_vocab), "pytorch_model.bin")


def yuhuili_eagle3_narrow(directory: Path, hidden: int = 128) -> Path:
    """The 70B-style EAGLE-3: draft hidden != target hidden, `target_hidden_size`, its own embed_tokens."""
    torch.manual_seed(13)
    t = eagle3_tensors(hidden=hidden, draft_vocab=1024)
    t["embed_tokens.weight"] = _w(V, hidden, dtype=torch.float16)
    config = dict(LLAMA_LAYER_CONFIG, hidden_size=hidden, intermediate_size=FFN, head_dim=HD, draft_vocab_size=1024,
                  target_hidden_size=H)
    return _write(directory, config, t, "pytorch_model.bin")


def specforge_eagle3(directory: Path, layer_ids=(0, 2, 4), draft_vocab: int = 2048) -> Path:
    """SpecForge: bf16 model.safetensors, embed dropped, LlamaForCausalLMEagle3, nested eagle_config ids in
    the output-of-layer convention."""
    torch.manual_seed(14)
    config = dict(LLAMA_LAYER_CONFIG, architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=draft_vocab,
                  torch_dtype="bfloat16",
                  eagle_config={"eagle_aux_hidden_state_layer_ids": list(layer_ids), "use_aux_hidden_state": True})
    return _write(directory, config, eagle3_tensors(draft_vocab=draft_vocab, dtype=torch.bfloat16), "model.safetensors")


def speculators_eagle3(directory: Path, layer_ids=(1, 3, 5), verifier: str = "org/demo-code-7m") -> Path:
    """speculators EAGLE-3: layers.0.* names, embed_tokens saved, transformer_layer_config (section 4)."""
    torch.manual_seed(15)
    t = eagle3_tensors(prefix="layers.0.", dtype=torch.bfloat16)
    t["embed_tokens.weight"] = _w(V, H, dtype=torch.bfloat16)
    config = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3", "speculators_version": "0.3.0",
              "speculators_config": {"algorithm": "eagle3", "proposal_methods": [
                  {"proposal_type": "greedy", "speculative_tokens": 3, "verifier_accept_k": 1, "accept_tolerance": 0.0}],
                  "default_proposal_method": "greedy",
                  "verifier": {"name_or_path": verifier, "architectures": ["LlamaForCausalLM"]}},
              "transformer_layer_config": dict(LLAMA_LAYER_CONFIG, torch_dtype="bfloat16"),
              "draft_vocab_size": 2048, "norm_before_residual": False, "target_hidden_size": None,
              "eagle_aux_hidden_state_layer_ids": list(layer_ids), "norm_before_fc": False, "fc_norm": False,
              "norm_output": False, "embed_requires_grad": False}
    return _write(directory, config, t, "model.safetensors")


def speculators_legacy_eagle(directory: Path, fusion_bias: bool = True) -> Path:
    """The removed legacy speculators EAGLE type: fusion_fc.*, transformer.* (section 4.1)."""
    torch.manual_seed(16)
    t = {"fusion_fc.weight": _w(H, 2 * H)}
    if fusion_bias:
        t["fusion_fc.bias"] = _w(H)
    t |= attention("transformer.", H) | mlp("transformer.")
    t["transformer.post_attention_layernorm.weight"] = _norm(H)
    config = {"architectures": ["EagleSpeculator", "LlamaDecoderLayer"], "speculators_model_type": "eagle",
              "speculators_config": {"algorithm": "eagle", "proposal_methods": [
                  {"proposal_type": "greedy", "speculative_tokens": 5}], "default_proposal_method": "greedy",
                  "verifier": {"name_or_path": "org/demo", "architectures": ["LlamaForCausalLM"]}},
              "transformer_layer_architecture": "LlamaDecoderLayer", "transformer_layer_config": LLAMA_LAYER_CONFIG,
              "layernorms": False, "fusion_bias": fusion_bias}
    return _write(directory, config, t, "model.safetensors")
