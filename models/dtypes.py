"""The one table of dtype names accepted anywhere in draftsmith (flags, recipes, configs)."""

from __future__ import annotations

import torch

from draftsmith.errors import DraftsmithError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise DraftsmithError(f"unknown dtype {name!r}; choose one of {', '.join(DTYPES)}")
    return DTYPES[name]
