"""Tokenizer and end-of-sequence ids of an HF model directory, shared by serving, training and conversion."""

from __future__ import annotations

import json
from pathlib import Path

from draftsmith.errors import DraftsmithError


def load_tokenizer(model_dir: str | Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    except Exception as exc:  # transformers raises many types for a missing/broken tokenizer
        raise DraftsmithError(f"cannot load a tokenizer from {model_dir}: {exc}") from None


def eos_token_ids(model_dir: str | Path, config_eos: tuple[int, ...], tokenizer) -> set[int]:
    ids = set(config_eos)
    gen_config = Path(model_dir) / "generation_config.json"
    if gen_config.is_file():
        eos = json.loads(gen_config.read_text()).get("eos_token_id")
        ids |= set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids
