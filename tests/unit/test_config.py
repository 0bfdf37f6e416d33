import json

import pytest

from draftsmith.errors import DraftsmithError, UnsupportedModelError
from draftsmith.models.config import TargetConfig

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
