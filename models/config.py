"""Architecture config of a target model, parsed from an HF `config.json`.

One frozen dataclass covers the Llama family (Llama 2/3/3.1/3.2, Mistral, Qwen2, Qwen3); the per-family
differences (qkv bias, q/k norm, sliding window) are fields, filled from the `ARCHITECTURES` table, so the
model code never branches on a family name.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from draftsmith.errors import DraftsmithError, UnsupportedModelError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class ArchFamily:
    """What a `model_type` adds to the plain Llama block."""

    qkv_bias_default: bool = False  # Qwen2 has q/k/v biases without saying so in the config
    qk_norm: bool = False  # Qwen3 RMS-normalizes q and k per head before rope
    sliding_window_key: str | None = None  # config key that switches the window on, if any


ARCHITECTURES: dict[str, ArchFamily] = {
    "llama": ArchFamily(),
    "mistral": ArchFamily(sliding_window_key="sliding_window"),
    "qwen2": ArchFamily(qkv_bias_default=True, sliding_window_key="use_sliding_window"),
    "qwen3": ArchFamily(qk_norm=True, sliding_window_key="use_sliding_window"),
}


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    type: str = "default"
    factor: float = 1.0
    # llama3 scaling only
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class TargetConfig:
    """Shapes and options of a decoder-only target; field names follow HF's config keys."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = field(default_factory=RopeConfig)
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    torch_dtype: str = "float32"
    eos_token_ids: tuple[int, ...] = ()

    @property
    def num_kv_groups(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> TargetConfig:
        model_type = cfg.get("model_type")
        if model_type not in ARCHITECTURES:
            raise UnsupportedModelError(
                f"model_type {model_type!r} (architectures {cfg.get('architectures')}) is not supported; "
                f"supported: {', '.join(sorted(ARCHITECTURES))}"
            )
        family = ARCHITECTURES[model_type]
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(f"hidden_act {act!r} is not supported; only 'silu'")
        try:
            hidden = int(cfg["hidden_size"])
            heads = int(cfg["num_attention_heads"])
            head_dim = cfg.get("head_dim") or hidden // heads
            attention_bias = bool(cfg.get("attention_bias", family.qkv_bias_default))
            eos = cfg.get("eos_token_id")
            return cls(
                model_type=model_type,
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_hidden_layers=int(cfg["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(head_dim),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope=parse_rope(cfg),
                max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                # Llama's attention_bias covers o_proj too; Qwen2's implicit bias does not.
                qkv_bias=attention_bias or family.qkv_bias_default,
                o_bias=attention_bias and model_type == "llama",
                mlp_bias=bool(cfg.get("mlp_bias", False)),
                qk_norm=family.qk_norm,
                sliding_window=_sliding_window(cfg, family),
                torch_dtype=str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32"),
                eos_token_ids=tuple(eos if isinstance(eos, list) else [] if eos is None else [eos]),
            )
        except KeyError as exc:
            raise DraftsmithError(f"config.json lacks required key {exc.args[0]!r}") from None

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> TargetConfig:
        path = Path(model_dir) / "config.json"
        if not Path(model_dir).is_dir():
            raise DraftsmithError(f"model directory {str(model_dir)!r} does not exist")
        if not path.is_file():
            raise DraftsmithError(f"{path} not found: expected an HF model directory with config.json")
        try:
            cfg = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise DraftsmithError(f"{path} is not valid JSON: {exc}") from None
        return cls.from_hf_dict(cfg)


def parse_rope(cfg: dict[str, Any]) -> RopeConfig:
    """Reads rope settings from the newer `rope_parameters` dict or the older `rope_theta` + `rope_scaling`."""
    params = cfg.get("rope_parameters")
    if params is None:
        params = dict(cfg.get("rope_scaling") or {})
        params.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"rope type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    defaults = RopeConfig()
    return RopeConfig(
        theta=float(theta),
        type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", defaults.low_freq_factor)),
        high_freq_factor=float(params.get("high_freq_factor", defaults.high_freq_factor)),
        original_max_position_embeddings=int(
            params.get("original_max_position_embeddings", defaults.original_max_position_embeddings)
        ),
    )


def _sliding_window(cfg: dict[str, Any], family: ArchFamily) -> int | None:
    if family.sliding_window_key is None:
        return None
    if family.sliding_window_key == "sliding_window":
        return cfg.get("sliding_window") or None
    if cfg.get(family.sliding_window_key):
        # Qwen2/3 window only some layers (max_window_layers); not implemented rather than silently wrong.
        raise UnsupportedModelError(f"{cfg['model_type']} with use_sliding_window=true is not supported")
    return None
