"""Tiny checkpoints in the exact public layouts (key names, shapes, file types, config keys) as the shared
format notes describe them (../shared/docs/formats.md in CI), random values, sized to the demo model (hidden 256, 6 layers, vocab 8192) so converted heads can
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


def convert(*args, check: bool = False) -> int:
    """`draftsmith convert ARGS` through the console entry point; returns its exit status. The acceptance
    gate that follows a conversion with --target is skipped unless `check`: these checkpoints are random."""
    from draftsmith.cli import main

    return main(["convert", *map(str, args), *([] if check else ["--no-check"])])


def read_native(out: Path):
    """(config dict, tensors) of a native head directory."""
    from safetensors.torch import load_file

    return json.loads((out / "config.json").read_text()), load_file(str(out / "model.safetensors"))


def source_tensors(directory: Path) -> dict:
    from draftsmith.methods.formats.checkpoint import SourceCheckpoint

    checkpoint = SourceCheckpoint(directory)
    return checkpoint.read(checkpoint.names)


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


def specforge_eagle3_1(directory: Path, legacy_names: bool = True) -> Path:
    """SpecForge's "EAGLE-3.1" output (configs/*-eagle3.1.json): the SpecForge layout plus `fc_norm: true`
    with a norm per fused layer, `fc_norm.{0,1,2}.weight` (older releases: `aux_norm_{low,mid,high}.weight`,
    which SGLang still maps), and `norm_output: true` (SpecForge: the final norm precedes the LM head)."""
    directory = specforge_eagle3(directory)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "fc_norm": True, "norm_output": True}, indent=2))
    from safetensors.torch import load_file

    t = load_file(str(directory / "model.safetensors"))
    names = [f"aux_norm_{level}.weight" for level in ("low", "mid", "high")] if legacy_names else \
        [f"fc_norm.{i}.weight" for i in range(3)]
    t.update({name: _norm(H, torch.bfloat16) for name in names})
    return _write(directory, None, t, "model.safetensors")


def speculators_eagle3(directory: Path, layer_ids=(1, 3, 5), verifier: str = "org/demo-code-7m",
                       embed_requires_grad: bool = False, norm_before_residual: bool = False,
                       norm_before_fc: bool = False, fc_norm: bool = False, norm_output: bool = False,
                       qwen3: bool = False, sliding_window: int | None = None) -> Path:
    """speculators EAGLE-3: layers.0.* names, embed_tokens saved, transformer_layer_config (section 4); with
    `embed_requires_grad` (speculators' training flag) that embedding is the head's own, trained. The variant
    flags add what section 4.2 lists with them: `input_norm.weight` [3H] (norm_before_fc), `fc_norm.{i}.weight`
    [H] (fc_norm), a Qwen3 layer's `self_attn.{q,k}_norm.weight` [head_dim]; a window is written as speculators'
    trainer writes it (layer_types, use_sliding_window)."""
    torch.manual_seed(15)
    t = eagle3_tensors(prefix="layers.0.", dtype=torch.bfloat16)
    t["embed_tokens.weight"] = _w(V, H, dtype=torch.bfloat16)
    if norm_before_fc:
        t["input_norm.weight"] = _norm(3 * H, torch.bfloat16)
    for i in range(3 if fc_norm else 0):
        t[f"fc_norm.{i}.weight"] = _norm(H, torch.bfloat16)
    layer = dict(LLAMA_LAYER_CONFIG, torch_dtype="bfloat16")
    if qwen3:
        t["layers.0.self_attn.q_norm.weight"] = _norm(HD, torch.bfloat16)
        t["layers.0.self_attn.k_norm.weight"] = _norm(HD, torch.bfloat16)
        layer.update(architectures=["Qwen3ForCausalLM"], model_type="qwen3", head_dim=HD)
    if sliding_window is not None:
        layer.update(sliding_window=sliding_window, use_sliding_window=True, layer_types=["sliding_attention"])
    config = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3", "speculators_version": "0.3.0",
              "speculators_config": {"algorithm": "eagle3", "proposal_methods": [
                  {"proposal_type": "greedy", "speculative_tokens": 3, "verifier_accept_k": 1, "accept_tolerance": 0.0}],
                  "default_proposal_method": "greedy",
                  "verifier": {"name_or_path": verifier, "architectures": ["LlamaForCausalLM"]}},
              "transformer_layer_config": layer,
              "draft_vocab_size": 2048, "norm_before_residual": norm_before_residual, "target_hidden_size": None,
              "eagle_aux_hidden_state_layer_ids": list(layer_ids), "norm_before_fc": norm_before_fc,
              "fc_norm": fc_norm, "norm_output": norm_output, "embed_requires_grad": embed_requires_grad}
    return _write(directory, config, t, "model.safetensors")


def speculators_default(directory: Path, verifier: str = "org/demo-code-7m") -> Path:
    """What speculators 0.9 trains by default (its TrainConfig): norm_before_residual, norm_before_fc and
    norm_output on, every draft layer sliding with a 2048 window."""
    return speculators_eagle3(directory, verifier=verifier, norm_before_residual=True, norm_before_fc=True,
                              norm_output=True, sliding_window=2048)


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


def mlp_speculator(directory: Path, n_predict: int = 3, inner: int = 192, tied: bool = False, all_names: bool = True,
                   scale_input: bool = False) -> Path:
    """IBM/fms MLP speculator as HF saves it: `speculator.`-prefixed stages (section 5)."""
    torch.manual_seed(17)
    stages = range(n_predict)
    t = {}
    for i in stages:
        t[f"speculator.emb.{i}.weight"] = _w(V, inner)
        t[f"speculator.proj.{i}.weight"] = _w(inner, H if i == 0 else inner)
        t[f"speculator.head.{i}.weight"] = _w(V, inner)
        t[f"speculator.ln.{i}.weight"] = _norm(inner)
        t[f"speculator.ln.{i}.bias"] = _w(inner)
    if tied:  # every stage shares stage 0's emb/head/ln; proj.i (i >= 2) shares proj.1
        for name in list(t):
            kind, index = name.split(".")[1], int(name.split(".")[2])
            shared = 1 if kind == "proj" and index >= 1 else 0
            if index != shared:
                if all_names:
                    t[name] = t[name.replace(f".{index}.", f".{shared}.", 1)].clone()
                else:
                    del t[name]
    config = {"architectures": ["MLPSpeculatorPreTrainedModel"], "model_type": "mlp_speculator", "vocab_size": V,
              "emb_dim": H, "inner_dim": inner, "n_predict": n_predict, "top_k_tokens_per_head": [5, 4, 3][:n_predict],
              "n_candidates": 5, "tie_weights": tied, "scale_input": scale_input}
    return _write(directory, config, t, "model.safetensors")


def medusa(directory: Path, heads: int = 3, layers: int = 1, lm_heads: bool = True,
           weights: str = "medusa_lm_head.pt") -> Path:
    """FasterDecoding Medusa: `{h}.{j}.linear.*` ResBlocks (one module repeated L times) and `{h}.{L}.weight`;
    the config's head count is the uploaded '5' that disagrees with the weights (section 6)."""
    torch.manual_seed(18)
    t = {}
    for h in range(heads):
        block_w, block_b = _w(H, H), _w(H)
        for j in range(layers):  # [ResBlock(H)] * L: the same tensors under every j
            t[f"{h}.{j}.linear.weight"], t[f"{h}.{j}.linear.bias"] = block_w, block_b
        if lm_heads:
            t[f"{h}.{layers}.weight"] = _w(V, H)
    if weights.endswith(".safetensors"):
        t = {k: v.clone() for k, v in t.items()}
    config = {"medusa_num_heads": 5, "medusa_num_layers": layers, "base_model_name_or_path": "org/demo-code-7m",
              "version": "2"}
    return _write(directory, config, t, weights)


def _shard(directory: Path, config: dict, shards: dict[str, dict]) -> Path:
    """A sharded HF checkpoint: model-0000i-of-N.safetensors plus model.safetensors.index.json."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    weight_map = {}
    for file, tensors in shards.items():
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(directory / file))
        weight_map |= dict.fromkeys(tensors, file)
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return directory


MTP_H, MTP_V = 64, 128


def _block(prefix: str, moe: bool) -> dict:
    t = {f"{prefix}input_layernorm.weight": _norm(MTP_H), f"{prefix}post_attention_layernorm.weight": _norm(MTP_H),
         f"{prefix}self_attn.q_proj.weight": _w(MTP_H, MTP_H), f"{prefix}self_attn.o_proj.weight": _w(MTP_H, MTP_H)}
    if moe:  # FP8 expert weights with their block scales, as DeepSeek-V3 ships them
        t[f"{prefix}mlp.experts.0.gate_proj.weight"] = _w(32, MTP_H).to(torch.float8_e4m3fn)
        t[f"{prefix}mlp.experts.0.gate_proj.weight_scale_inv"] = torch.rand(1, 1)
        t[f"{prefix}mlp.gate.weight"] = _w(4, MTP_H)
    else:
        t[f"{prefix}mlp.gate_proj.weight"] = _w(32, MTP_H)
    return t


def _main_model(layers: int) -> dict:
    t = {"model.embed_tokens.weight": _w(MTP_V, MTP_H), "model.norm.weight": _norm(MTP_H), "lm_head.weight": _w(MTP_V, MTP_H)}
    for i in range(layers):
        t |= _block(f"model.layers.{i}.", moe=False)
    return t


def deepseek_target_with_mtp(directory: Path, layers: int = 2, mtp_layers: int = 1) -> Path:
    """DeepSeek-V3 layout: MTP layer(s) at model.layers.{L+k} with enorm/hnorm/eh_proj/shared_head, their own
    stored embed/head copies, in a shard of their own (section 7.1)."""
    torch.manual_seed(19)
    mtp = {}
    for k in range(mtp_layers):
        p = f"model.layers.{layers + k}."
        mtp |= {f"{p}enorm.weight": _norm(MTP_H), f"{p}hnorm.weight": _norm(MTP_H), f"{p}eh_proj.weight": _w(MTP_H, 2 * MTP_H),
                f"{p}shared_head.norm.weight": _norm(MTP_H), f"{p}shared_head.head.weight": _w(MTP_V, MTP_H),
                f"{p}embed_tokens.weight": _w(MTP_V, MTP_H), **_block(p, moe=True)}
    main = _main_model(layers)
    config = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": MTP_H,
              "vocab_size": MTP_V, "num_hidden_layers": layers, "num_nextn_predict_layers": mtp_layers,
              "n_routed_experts": 4}
    head = {k: main.pop(k) for k in ("lm_head.weight", "model.norm.weight")}
    return _shard(directory, config, {"model-00001-of-00003.safetensors": main, "model-00002-of-00003.safetensors": mtp,
                                      "model-00003-of-00003.safetensors": head})


def qwen3_next_target_with_mtp(directory: Path, layers: int = 2) -> Path:
    """Qwen3-Next: mtp.fc / mtp.pre_fc_norm_* / mtp.norm shared, blocks at mtp.layers.{k} (section 7.2)."""
    torch.manual_seed(20)
    mtp = {"mtp.fc.weight": _w(MTP_H, 2 * MTP_H), "mtp.pre_fc_norm_embedding.weight": _norm(MTP_H),
           "mtp.pre_fc_norm_hidden.weight": _norm(MTP_H), "mtp.norm.weight": _norm(MTP_H), **_block("mtp.layers.0.", moe=True)}
    config = {"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "hidden_size": MTP_H,
              "vocab_size": MTP_V, "num_hidden_layers": layers, "num_nextn_predict_layers": 1}
    return _shard(directory, config, {"model-00001-of-00002.safetensors": _main_model(layers),
                                      "model-00002-of-00002.safetensors": mtp})


def mimo_target_with_mtp(directory: Path, layers: int = 2) -> Path:
    """MiMo: model.mtp_layers.{k}.{token_layernorm,hidden_layernorm,input_proj,final_layernorm} (section 7.3)."""
    torch.manual_seed(21)
    p = "model.mtp_layers.0."
    mtp = {f"{p}token_layernorm.weight": _norm(MTP_H), f"{p}hidden_layernorm.weight": _norm(MTP_H),
           f"{p}input_proj.weight": _w(MTP_H, 2 * MTP_H), f"{p}final_layernorm.weight": _norm(MTP_H), **_block(p, moe=False)}
    config = {"architectures": ["MiMoForCausalLM"], "model_type": "mimo", "hidden_size": MTP_H, "vocab_size": MTP_V,
              "num_hidden_layers": layers, "num_nextn_predict_layers": 1}
    return _write(directory, config, _main_model(layers) | mtp, "model.safetensors")


def mimo_mtp_for(target_dir: Path, directory: Path, mtp_layers: int = 1) -> Path:
    """A MiMo-layout checkpoint (section 7.3) whose MTP layers fit the target at `target_dir`: its shapes, a Qwen2
    block (q/k/v biases) per layer, random weights; only the MTP tensors, as `convert --to vllm` writes them."""
    torch.manual_seed(22)
    shape = json.loads((Path(target_dir) / "config.json").read_text())
    h, inter = shape["hidden_size"], shape["intermediate_size"]
    q, kv = shape["num_attention_heads"] * shape["head_dim"], shape["num_key_value_heads"] * shape["head_dim"]
    tensors = {}
    for k in range(mtp_layers):
        p = f"model.mtp_layers.{k}."
        tensors |= {f"{p}token_layernorm.weight": _norm(h), f"{p}hidden_layernorm.weight": _norm(h),
                    f"{p}input_proj.weight": _w(h, 2 * h), f"{p}final_layernorm.weight": _norm(h),
                    f"{p}input_layernorm.weight": _norm(h), f"{p}post_attention_layernorm.weight": _norm(h),
                    f"{p}self_attn.q_proj.weight": _w(q, h), f"{p}self_attn.q_proj.bias": _w(q),
                    f"{p}self_attn.k_proj.weight": _w(kv, h), f"{p}self_attn.k_proj.bias": _w(kv),
                    f"{p}self_attn.v_proj.weight": _w(kv, h), f"{p}self_attn.v_proj.bias": _w(kv),
                    f"{p}self_attn.o_proj.weight": _w(h, q), f"{p}mlp.gate_proj.weight": _w(inter, h),
                    f"{p}mlp.up_proj.weight": _w(inter, h), f"{p}mlp.down_proj.weight": _w(h, inter)}
    config = {**shape, "architectures": ["MiMoForCausalLM"], "model_type": "mimo", "attention_bias": True,
              "num_nextn_predict_layers": mtp_layers}
    return _write(directory, config, tensors, "model.safetensors")
