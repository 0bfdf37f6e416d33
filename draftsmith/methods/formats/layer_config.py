"""Between draftsmith's head config and the HF Llama-style configs that EAGLE-family checkpoints carry for
their one decoder layer (yuhuili, SpecForge, the vLLM/SGLang loaders, speculators' transformer_layer_config).
"""

from __future__ import annotations

from typing import Any

from draftsmith.errors import DraftsmithError
from draftsmith.models.config import RopeConfig, parse_rope
from draftsmith.models.heads import DraftHeadConfig


def layer_fields(cfg: dict[str, Any], where: str) -> dict[str, Any]:
    """DraftHeadConfig fields of the decoder layer described by an HF Llama-style config."""
    try:
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        return {
            "hidden_size": hidden,
            "intermediate_size": int(cfg["intermediate_size"]),
            "num_attention_heads": heads,
            "num_key_value_heads": int(cfg.get("num_key_value_heads") or heads),
            "head_dim": int(cfg.get("head_dim") or hidden // heads),
            "rms_norm_eps": float(cfg.get("rms_norm_eps", 1e-6)),
            "rope": parse_rope(cfg),
            "max_position_embeddings": int(cfg.get("max_position_embeddings", 2048)),
        }
    except KeyError as exc:
        raise DraftsmithError(f"{where} lacks the layer config key {exc.args[0]!r}") from None
    except (TypeError, ValueError) as exc:
        raise DraftsmithError(f"{where} has a malformed layer config ({exc})") from None


def rope_keys(rope: RopeConfig | dict[str, Any]) -> dict[str, Any]:
    return (rope if isinstance(rope, RopeConfig) else RopeConfig(**rope)).hf_keys()


def llama_layer_config(config: dict[str, Any], architectures: list[str], dtype: str,
                       model_type: str = "llama") -> dict[str, Any]:
    """The HF Llama-style config of a head's decoder layers (its `num_hidden_layers`, 1 where it names none;
    the target's vocab)."""
    return {
        "architectures": architectures,
        "model_type": model_type,
        "hidden_size": config["hidden_size"],
        "intermediate_size": config["intermediate_size"],
        "num_attention_heads": config["num_attention_heads"],
        "num_key_value_heads": config["num_key_value_heads"],
        "head_dim": config["head_dim"],
        "num_hidden_layers": config.get("num_hidden_layers", 1),
        "hidden_act": "silu",
        "rms_norm_eps": config["rms_norm_eps"],
        "vocab_size": config["vocab_size"],
        "max_position_embeddings": config["max_position_embeddings"],
        **rope_keys(config["rope"]),
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
    }


def native_config(head_type: str, layer: dict[str, Any], **fields: Any) -> dict[str, Any]:
    """A validated native config.json dict (built through the dataclass, so every key is known)."""
    try:
        config = DraftHeadConfig(head_type=head_type, **layer, **fields)
    except TypeError as exc:
        raise DraftsmithError(f"cannot build a {head_type} head config: {exc}") from None
    return config.to_json()
