"""The one table of dtype names accepted anywhere in draftsmith (flags, recipes, configs)."""

from __future__ import annotations

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

