"""Architecture config of a target model, parsed by transformers' own config classes.

One frozen dataclass covers the Llama family (Llama 2/3/3.1/3.2, Mistral, Qwen2, Qwen3); the per-family
differences (biases, q/k norm, sliding window) are fields, filled from the `ARCHITECTURES` table, so the
model code never branches on a family name. transformers reads `config.json` and applies each family's
defaults; `TargetConfig` is the small, frozen view of it that the runtime uses.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from draftsmith.errors import DraftsmithError, UnsupportedModelError

if TYPE_CHECKING:
    from transformers import PretrainedConfig

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
# transformers would default these silently (a 4096-wide Llama); a config without them is a broken one.
REQUIRED_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


@dataclass(frozen=True)
class ArchFamily:
    """What a `model_type` adds to the plain Llama block.

    A bias field is None where HF's attention module reads `attention_bias` (or `mlp_bias`) from the config,
    and a fixed value where the module hard-codes it and ignores the key.
    """

    qkv_bias: bool | None = None
    o_bias: bool | None = None
    mlp_bias: bool | None = False
    qk_norm: bool = False  # Qwen3 RMS-normalizes q and k per head before rope
    sliding_window_key: str | None = None  # config key that switches the window on, if any


ARCHITECTURES: dict[str, ArchFamily] = {
    "llama": ArchFamily(mlp_bias=None),
    "mistral": ArchFamily(qkv_bias=False, o_bias=False, sliding_window_key="sliding_window"),
    "qwen2": ArchFamily(qkv_bias=True, o_bias=False, sliding_window_key="use_sliding_window"),
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

    def hf_keys(self) -> dict[str, Any]:
        """HF config keys for this rope: `rope_theta` plus `rope_scaling` unless unscaled.

        This older spelling is the one every supported transformers release accepts (5.x folds it into
        `rope_parameters`).
        """
        keys: dict[str, Any] = {"rope_theta": self.theta}
        if self.type == "linear":
            keys["rope_scaling"] = {"rope_type": "linear", "factor": self.factor}
        elif self.type == "llama3":
            keys["rope_scaling"] = {"rope_type": "llama3", "factor": self.factor,
                                    "low_freq_factor": self.low_freq_factor, "high_freq_factor": self.high_freq_factor,
                                    "original_max_position_embeddings": self.original_max_position_embeddings}
        return keys


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

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> TargetConfig:
        """Reads `model_dir/config.json` with transformers' config reader (local files only)."""
        from transformers import PretrainedConfig
        from transformers.utils import CONFIG_NAME

        path = Path(model_dir) / CONFIG_NAME
        if not Path(model_dir).is_dir():
            raise DraftsmithError(f"model directory {str(model_dir)!r} does not exist")
        if not path.is_file():
            raise DraftsmithError(f"{path} not found: expected an HF model directory with config.json")
        try:
            # The same reader AutoConfig.from_pretrained uses; the dict is checked before a class is picked.
            cfg, _ = PretrainedConfig.get_config_dict(str(model_dir), local_files_only=True)
        except OSError as exc:  # transformers reports bad JSON as an OSError
            reason = "is not valid JSON" if "JSON" in str(exc) else "cannot be read"
            raise DraftsmithError(f"{path} {reason}: {exc}") from None
        return cls.from_hf_dict(cfg)

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> TargetConfig:
        """Builds the family's transformers config class from a `config.json` dict, then `from_hf_config`."""
        from transformers import CONFIG_MAPPING

        model_type = cfg.get("model_type")
        if model_type not in ARCHITECTURES:
            raise UnsupportedModelError(
                f"model_type {model_type!r} (architectures {cfg.get('architectures')}) is not supported; "
                f"supported: {', '.join(sorted(ARCHITECTURES))}"
            )
        missing = [key for key in REQUIRED_KEYS if key not in cfg]
        if missing:
            raise DraftsmithError(f"config.json lacks required key {missing[0]!r}")
        try:
            # transformers 5 fills in nested rope dicts in place; the caller's dict stays as it was.
            hf_config = CONFIG_MAPPING[model_type].from_dict(copy.deepcopy(cfg))
        except (KeyError, TypeError, ValueError) as exc:
            raise DraftsmithError(f"config.json is not a valid {model_type} config: {exc}") from None
        return cls.from_hf_config(hf_config)

    @classmethod
    def from_hf_config(cls, hf_config: PretrainedConfig) -> TargetConfig:
        """The runtime view of a transformers config object (`PretrainedConfig`) of a supported family."""
        model_type = hf_config.model_type
        family = ARCHITECTURES.get(model_type)
        if family is None:
            raise UnsupportedModelError(
                f"model_type {model_type!r} is not supported; supported: {', '.join(sorted(ARCHITECTURES))}"
            )
        act = getattr(hf_config, "hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(f"hidden_act {act!r} is not supported; only 'silu'")
        attention_bias = bool(getattr(hf_config, "attention_bias", False))
        mlp_bias = bool(getattr(hf_config, "mlp_bias", False))
        eos = getattr(hf_config, "eos_token_id", None)
        rope, sliding_window = parse_rope(_rope_keys(hf_config)), _sliding_window(hf_config, family)
        try:
            heads = int(hf_config.num_attention_heads)
            hidden = int(hf_config.hidden_size)
            return cls(
                model_type=model_type,
                vocab_size=int(hf_config.vocab_size),
                hidden_size=hidden,
                intermediate_size=int(hf_config.intermediate_size),
                num_hidden_layers=int(hf_config.num_hidden_layers),
                num_attention_heads=heads,
                num_key_value_heads=int(getattr(hf_config, "num_key_value_heads", None) or heads),
                # what HF's attention modules do: an explicit head_dim wins, else hidden / heads
                head_dim=int(getattr(hf_config, "head_dim", None) or hidden // heads),
                rms_norm_eps=float(hf_config.rms_norm_eps),
                rope=rope,
                max_position_embeddings=int(hf_config.max_position_embeddings),
                tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
                qkv_bias=attention_bias if family.qkv_bias is None else family.qkv_bias,
                o_bias=attention_bias if family.o_bias is None else family.o_bias,
                mlp_bias=mlp_bias if family.mlp_bias is None else family.mlp_bias,
                qk_norm=family.qk_norm,
                sliding_window=sliding_window,
                torch_dtype=_dtype_name(hf_config),
                eos_token_ids=tuple(eos if isinstance(eos, list) else [] if eos is None else [eos]),
            )
        except (AttributeError, TypeError, ValueError) as exc:
            raise DraftsmithError(f"config.json has a malformed {model_type} config: {exc}") from None


def parse_rope(cfg: dict[str, Any]) -> RopeConfig:
    """Reads rope settings from the newer `rope_parameters` dict or the older `rope_theta` + `rope_scaling`.

    Takes a plain dict: a whole `config.json` or the layer config of a draft-head checkpoint.
    """
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


def _rope_keys(hf_config: PretrainedConfig) -> dict[str, Any]:
    """The rope attributes of an HF config, whichever transformers parsed it.

    transformers 5 folds both spellings into `rope_parameters`. 4.x keeps `rope_theta` + `rope_scaling`, and
    keeps a newer file's `rope_parameters` as a plain attribute, which `parse_rope` rightly prefers.
    """
    keys = ("rope_parameters", "rope_scaling", "rope_theta")
    return {key: value for key in keys if (value := getattr(hf_config, key, None)) is not None}


def _dtype_name(hf_config: PretrainedConfig) -> str:
    # transformers 5 calls it `dtype` (and warns on reading `torch_dtype`); 4.x `torch_dtype`, a torch.dtype.
    dtype = hf_config.dtype if hasattr(hf_config, "dtype") else getattr(hf_config, "torch_dtype", None)
    return str(dtype or "float32").removeprefix("torch.")


def _sliding_window(hf_config: PretrainedConfig, family: ArchFamily) -> int | None:
    if family.sliding_window_key is None:
        return None
    if family.sliding_window_key == "sliding_window":
        return getattr(hf_config, "sliding_window", None) or None
    if getattr(hf_config, family.sliding_window_key, False):
        # Qwen2/3 window only some layers (max_window_layers); not implemented rather than silently wrong.
        raise UnsupportedModelError(f"{hf_config.model_type} with use_sliding_window=true is not supported")
    return None
