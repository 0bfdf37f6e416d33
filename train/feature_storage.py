"""How captured hidden states are stored (`data.hidden_states_dtype`): as bf16 or fp32, or as FP8.

FP8 is E4M3 with one fp32 scale per token and per layer (the layer's amax over 448, E4M3's largest value),
stored beside the values as `<name>_scale` [tokens, layers]. Hidden states carry a few outliers hundreds of
times the typical value, and a token's layers differ in scale, so one scale per tensor would flush most
values to zero and one per token (speculators' FP8 connector) lets a deep layer's outliers coarsen a shallow
layer's values. The scales cost 4 bytes a layer a token, against the hidden size in bytes saved.

Training computes in bf16 from an FP8 capture, and online training with `fp8` rounds its features through
FP8 exactly as a capture stores them, so online and offline batches stay equal.
"""

from __future__ import annotations

import torch

from draftsmith.models.dtypes import DTYPES

STORAGE_DTYPES = ("bfloat16", "float32", "fp8")
FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
SCALE_SUFFIX = "_scale"


def compute_dtype(storage: str) -> torch.dtype:
    """The dtype features are trained in when stored as `storage`."""
    return torch.bfloat16 if storage == "fp8" else DTYPES[storage]


def bytes_per_token(width: int, layers: int, storage: str) -> int:
    """Bytes one token's `layers` concatenated hidden states (`width` values in all) take on disk."""
    if storage == "fp8":
        return width + 4 * layers
    return width * DTYPES[storage].itemsize


def encode(values: torch.Tensor, layers: int, storage: str) -> dict[str, torch.Tensor]:
    """[tokens, layers * hidden] -> {"": stored values, "_scale": per token and layer scales (FP8 only)}."""
    if storage != "fp8":
        return {"": values.to(DTYPES[storage])}
    grouped = values.float().unflatten(-1, (layers, -1))
    scales = (grouped.abs().amax(-1) / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    return {"": (grouped / scales[..., None]).to(FP8).flatten(-2), SCALE_SUFFIX: scales}


def decode(stored: torch.Tensor, scales: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Stored values [tokens, layers * hidden] (and their scales [tokens, layers] if FP8) -> `dtype`."""
    if scales is None:
        return stored.to(dtype)
    grouped = stored.float().unflatten(-1, (scales.shape[-1], -1)) * scales.float()[..., None]
    return grouped.flatten(-2).to(dtype)


def round_trip(values: torch.Tensor, layers: int, storage: str) -> torch.Tensor:
    """What storing `values` as `storage` and reading them back for training gives."""
    encoded = encode(values, layers, storage)
    return decode(encoded[""], encoded.get(SCALE_SUFFIX), compute_dtype(storage))
