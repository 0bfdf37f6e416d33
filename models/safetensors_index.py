"""The one reader of sharded-checkpoint indexes (`*.safetensors.index.json`, `pytorch_model.bin.index.json`):
tensor name -> the shard file that holds it, with every named shard checked to exist."""

from __future__ import annotations

import json
from pathlib import Path

from draftsmith.errors import DraftsmithError


def read_weight_map(index: Path) -> dict[str, Path]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        where = {str(name): index.parent / str(shard) for name, shard in weight_map.items()}
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
        raise DraftsmithError(f"{index} is not a valid shard index ({type(exc).__name__}: {exc})") from None
    missing = sorted({p.name for p in where.values() if not p.is_file()})
    if missing:
        raise DraftsmithError(f"{index} names shards that do not exist: {', '.join(missing[:5])}")
    return where
