"""Loads an HF model directory (config.json + single or sharded safetensors) into `CausalLM`."""

from __future__ import annotations

from pathlib import Path

import safetensors
import torch
from safetensors import safe_open

from draftsmith.errors import DraftsmithError
from draftsmith.models.config import TargetConfig
from draftsmith.models.dtypes import DTYPES
from draftsmith.models.llama import CausalLM
from draftsmith.models.safetensors_index import read_weight_map

# Buffers some exporters save that we recompute.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# Older safetensors releases have no exported error class; their errors are OSError/RuntimeError.
_SAFETENSORS_ERRORS = (OSError, RuntimeError, getattr(safetensors, "SafetensorError", OSError))


def resolve_dtype(dtype: str | torch.dtype, config: TargetConfig, device: torch.device) -> torch.dtype:
    """`auto` = fp32 on CPU (bf16 matmuls are slow there), the checkpoint's dtype on an accelerator."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.float32 if device.type == "cpu" else DTYPES.get(config.torch_dtype, torch.bfloat16)
    if dtype not in DTYPES:
        raise DraftsmithError(f"unknown dtype {dtype!r}; choose one of auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        return sorted(set(read_weight_map(index).values()))
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    raise DraftsmithError(
        f"no weights in {model_dir}: expected model.safetensors or model.safetensors.index.json"
    )


def load_state_dict(model_dir: Path, dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for path in safetensors_files(model_dir):
        try:
            with safe_open(str(path), framework="pt", device=str(device)) as f:
                for name in f.keys():
                    if not name.endswith(_IGNORED_SUFFIXES):
                        state[name] = f.get_tensor(name).to(dtype)
        except _SAFETENSORS_ERRORS as exc:
            raise DraftsmithError(f"cannot read {path}: {exc}") from None
    return state


def load_target(model_dir: str | Path, dtype: str | torch.dtype = "auto", device: str | torch.device = "cpu",
                max_len: int | None = None) -> CausalLM:
    """Builds the model on the meta device and assigns the checkpoint tensors, so nothing is allocated twice."""
    model_dir = Path(model_dir)
    config = TargetConfig.from_model_dir(model_dir)
    device = torch.device(device)
    torch_dtype = resolve_dtype(dtype, config, device)
    with torch.device("meta"):
        model = CausalLM(config)
    state = load_state_dict(model_dir, torch_dtype, device)
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    expected = set(model.state_dict())
    if config.tie_word_embeddings:
        expected.discard("lm_head.weight")
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise DraftsmithError(
            f"checkpoint in {model_dir} does not match its config: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    try:
        model.load_state_dict(state, strict=False, assign=True)
    except RuntimeError as exc:  # shape mismatches
        raise DraftsmithError(f"checkpoint in {model_dir} does not match its config: {exc}") from None
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.eval().requires_grad_(False)
    model.init_rope(max(config.max_position_embeddings, max_len or 0))
    return model
