import json

import pytest

from draftsmith.errors import DraftsmithError, UnsupportedModelError
from draftsmith.models.config import RopeConfig, TargetConfig
from draftsmith.models.rope import inverse_frequencies, rope_tables
from draftsmith.models.tokenizer import eos_token_ids

BASE = dict(model_type="llama", vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
            num_attention_heads=2)


def test_unsupported_architecture_names_supported_ones():
    with pytest.raises(UnsupportedModelError, match="'gpt2'.*supported: llama, mistral, qwen2, qwen3"):
        TargetConfig.from_hf_dict({**BASE, "model_type": "gpt2"})


def test_legacy_rope_theta_and_rope_parameters_agree():
    legacy = TargetConfig.from_hf_dict({**BASE, "rope_theta": 500000.0, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}})
    newer = TargetConfig.from_hf_dict({**BASE, "rope_parameters": {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}})
    assert legacy.rope == newer.rope
    assert newer.rope.type == "llama3" and newer.rope.theta == 500000.0
    # the oldest spelling used "type"
    old = TargetConfig.from_hf_dict({**BASE, "rope_theta": 7.0, "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert (old.rope.type, old.rope.theta, old.rope.factor) == ("linear", 7.0, 2.0)


def test_unknown_rope_type_is_an_error():
    with pytest.raises(UnsupportedModelError, match="'yarn'"):
        TargetConfig.from_hf_dict({**BASE, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})


def test_family_options():
    qwen2 = TargetConfig.from_hf_dict({**BASE, "model_type": "qwen2"})
    assert qwen2.qkv_bias and not qwen2.o_bias
    qwen3 = TargetConfig.from_hf_dict({**BASE, "model_type": "qwen3", "head_dim": 32})
    assert qwen3.qk_norm and qwen3.head_dim == 32
    llama = TargetConfig.from_hf_dict({**BASE, "attention_bias": True})
    assert llama.qkv_bias and llama.o_bias
    assert TargetConfig.from_hf_dict({**BASE, "model_type": "mistral", "sliding_window": 4096}).sliding_window == 4096
    with pytest.raises(UnsupportedModelError, match="use_sliding_window"):
        TargetConfig.from_hf_dict({**BASE, "model_type": "qwen2", "use_sliding_window": True})


def test_missing_key_and_bad_dirs(tmp_path):
    with pytest.raises(DraftsmithError, match="'hidden_size'"):
        TargetConfig.from_hf_dict({k: v for k, v in BASE.items() if k != "hidden_size"})
    with pytest.raises(DraftsmithError, match="does not exist"):
        TargetConfig.from_model_dir(tmp_path / "nope")
    with pytest.raises(DraftsmithError, match="config.json not found"):
        TargetConfig.from_model_dir(tmp_path)
    (tmp_path / "config.json").write_text("{oops")
    with pytest.raises(DraftsmithError, match="not valid JSON"):
        TargetConfig.from_model_dir(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**BASE, "hidden_act": "gelu"}))
    with pytest.raises(UnsupportedModelError, match="gelu"):
        TargetConfig.from_model_dir(tmp_path)


def test_dict_is_parsed_by_the_family_config_class():
    # transformers' Qwen3Config defaults head_dim to 128, and Qwen3 puts attention_bias on o_proj too
    qwen3 = TargetConfig.from_hf_dict({**BASE, "model_type": "qwen3", "attention_bias": True})
    assert qwen3.head_dim == 128 and qwen3.qkv_bias and qwen3.o_bias
    # HF's Mistral has no biases whatever the config says; Llama's mlp_bias is honoured
    mistral = TargetConfig.from_hf_dict({**BASE, "model_type": "mistral", "attention_bias": True, "mlp_bias": True})
    assert not (mistral.qkv_bias or mistral.o_bias or mistral.mlp_bias)
    assert TargetConfig.from_hf_dict({**BASE, "mlp_bias": True}).mlp_bias
    config = {**BASE, "dtype": "bfloat16", "eos_token_id": [5, 7],
              "rope_parameters": {"rope_type": "linear", "rope_theta": 3.0, "factor": 2.0}}
    snapshot = json.dumps(config)
    parsed = TargetConfig.from_hf_dict(config)
    assert json.dumps(config) == snapshot  # the caller's dict is left alone
    assert (parsed.torch_dtype, parsed.eos_token_ids, parsed.rope.theta) == ("bfloat16", (5, 7), 3.0)
    assert TargetConfig.from_hf_dict({**BASE, "torch_dtype": "float16"}).torch_dtype == "float16"


def test_from_model_dir_and_from_hf_config_agree(tmp_path):
    from transformers import AutoConfig

    config = {**BASE, "num_key_value_heads": 1, "rope_theta": 500000.0, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}, "max_position_embeddings": 512}
    (tmp_path / "config.json").write_text(json.dumps(config))
    from_dir = TargetConfig.from_model_dir(tmp_path)
    assert from_dir == TargetConfig.from_hf_dict(config)
    assert from_dir == TargetConfig.from_hf_config(AutoConfig.from_pretrained(tmp_path, local_files_only=True))
    assert from_dir.num_key_value_heads == 1 and from_dir.rope.original_max_position_embeddings == 64


@pytest.mark.parametrize("rope_scaling", [
    None,
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
], ids=["default", "linear", "llama3"])
def test_rope_tables_equal_transformers_rotary_embedding(rope_scaling):
    """Bit for bit: the tables come from transformers' rope init functions, read through TargetConfig."""
    import torch
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    hf_config = LlamaConfig(**{**BASE, "hidden_size": 64, "num_attention_heads": 2}, rope_theta=500000.0,
                            rope_scaling=rope_scaling, max_position_embeddings=1024)
    ours = TargetConfig.from_hf_config(hf_config)
    cos, sin = rope_tables(ours.rope, ours.head_dim, 1024)
    positions = torch.arange(1024)[None]
    ref_cos, ref_sin = LlamaRotaryEmbedding(hf_config)(torch.zeros(1, dtype=torch.float32), positions)
    assert torch.equal(cos, ref_cos[0]) and torch.equal(sin, ref_sin[0])


def test_rope_tables_refuse_unsupported_types():
    with pytest.raises(UnsupportedModelError, match="'yarn'"):
        inverse_frequencies(RopeConfig(type="yarn", factor=4.0), 64)


def test_eos_ids_from_generation_config(tmp_path):
    class Tok:
        eos_token_id = 2

    assert eos_token_ids(tmp_path, (1,), Tok()) == {1, 2}  # no generation_config.json: fine
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 8]}))
    assert eos_token_ids(tmp_path, (1,), Tok()) == {1, 2, 7, 8}
    (tmp_path / "generation_config.json").write_text("{oops")
    with pytest.raises(DraftsmithError, match="generation_config.json"):
        eos_token_ids(tmp_path, (1,), Tok())
