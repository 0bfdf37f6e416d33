"""Paths and tiny-checkpoint factories shared by the tests (importable: tests/ is on pythonpath)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
DEMO_MODEL = REPO / "assets" / "demo-code-7m"
SHARED = Path(os.environ.get("DRAFTSMITH_SHARED", REPO.parent / "shared"))


def shared_path(*parts: str) -> Path:
    """A path under ../shared, or a skip: a user's fresh clone has no ../shared (CI does)."""
    path = SHARED.joinpath(*parts)
    if not path.exists():
        pytest.skip(f"{path} not found: ../shared (house model, corpus) only exists in CI and the dev workspace")
    return path


# Tiny random configs per supported family (real values in comments where they differ a lot).
TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3,  # Llama-3-8B: 4096, 32
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
TINY_FAMILIES = {
    "llama": ("LlamaConfig", dict(tie_word_embeddings=False)),
    "llama-bias-tied": ("LlamaConfig", dict(attention_bias=True, mlp_bias=True, tie_word_embeddings=True)),
    "llama3.1-rope": ("LlamaConfig", dict(rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 32})),
    "mistral-window": ("MistralConfig", dict(sliding_window=8)),
    "qwen2": ("Qwen2Config", dict()),
    "qwen3": ("Qwen3Config", dict(head_dim=32)),
}


def make_tiny_checkpoint(family: str, directory: Path, max_shard_size: str | None = None):
    """Saves a random HF model of `family` to `directory` and returns the HF model (fp32, eval)."""
    import transformers

    config_class, extra = TINY_FAMILIES[family]
    config = getattr(transformers, config_class)(**TINY, **extra)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(directory, **kwargs)
    return model
