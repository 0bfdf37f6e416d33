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


def layer_count(config: dict, where: str) -> int:
    """The head's decoder layers (`num_hidden_layers`, 1 when absent)."""
    layers = config.get("num_hidden_layers", 1)
    if not isinstance(layers, int) or layers < 1:
        raise DraftsmithError(f"{where}: num_hidden_layers must be a positive integer, not {layers!r}")
    return layers


def sliding_window(config: dict) -> int | None:
    """The window of the draft layers an HF layer config describes, as transformers builds it:
    `layer_types[0]` when given (what speculators' trainer writes: all draft layers slide by default), else
    Qwen2/3's `use_sliding_window` from layer `max_window_layers` on; None for full attention."""
    window, types, layers = config.get("sliding_window"), config.get("layer_types"), layer_count(config, "config.json")
    if types and len(set(types[:layers])) > 1:
        raise DraftsmithError(f"the draft layers mix attention types ({types}); draftsmith's draft heads attend "
                              "alike in every layer")
    if types:
        sliding = types[0] == "sliding_attention"
    else:
        first_sliding = int(config.get("max_window_layers", 28))  # Qwen2/3: layers from this one on slide
        if config.get("use_sliding_window") and 0 < first_sliding < layers:
            raise DraftsmithError(f"the draft layers mix attention types (layers from {first_sliding} on slide); "
                                  "draftsmith's draft heads attend alike in every layer")
        sliding = bool(config.get("use_sliding_window")) and first_sliding <= 0
    if sliding and not window:
        raise DraftsmithError("the draft layer uses sliding-window attention but the config gives no sliding_window")
    return int(window) if sliding else None


def vllm_window(config: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """(config keys, notes) of a native head config's window in vLLM's layout: every draft layer
    `sliding_attention`. vLLM slides each query's window at its own position: as draftsmith serves step 1 and
    P-EAGLE's slots; a sequential head's later draft steps, which draftsmith gives the verified prefix's newest
    W keys (the window speculators trains), see up to k - 1 fewer there."""
    window = config.get("sliding_window")
    if window is None:
        return {}, []
    layers = config.get("num_hidden_layers", 1)
    note = (f"sliding window {window}: needs vLLM 0.32 or later (older releases attend over every position); "
            "a sequential head's draft steps after the first see up to k - 1 fewer of the verified prefix's keys "
            "there than draftsmith gives them")
    return {"layer_types": ["sliding_attention"] * layers, "sliding_window": window}, [note]
