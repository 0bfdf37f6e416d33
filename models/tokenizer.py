"""Tokenizer and end-of-sequence ids of an HF model directory, shared by serving, training and conversion."""

from __future__ import annotations

from pathlib import Path

from draftsmith.errors import DraftsmithError


def load_tokenizer(model_dir: str | Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    except Exception as exc:  # transformers raises many types for a missing/broken tokenizer
        raise DraftsmithError(f"cannot load a tokenizer from {model_dir}: {exc}") from None


VOCABULARY_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


def check_same_vocabulary(tokenizer, draft_dir: str | Path, what: str) -> None:
    """A draft LM's token ids are read as the target's own: its vocabulary (token -> id) must be the target's
    `tokenizer`'s, not just as large. A draft folder without tokenizer files has only its vocabulary size to
    go by (checked where its config is read)."""
    if not any((Path(draft_dir) / name).is_file() for name in VOCABULARY_FILES):
        return
    theirs, ours = load_tokenizer(draft_dir).get_vocab(), tokenizer.get_vocab()
    if theirs == ours:
        return
    differ = sorted(t for t in set(ours) | set(theirs) if ours.get(t) != theirs.get(t))
    raise DraftsmithError(f"{what} {draft_dir} has another tokenizer than the target's: {len(differ)} tokens differ "
                          f"(e.g. {differ[0]!r}: id {ours.get(differ[0])} in the target's, {theirs.get(differ[0])} in "
                          "the draft's); a draft model must share the target's tokenizer")


def eos_token_ids(model_dir: str | Path, config_eos: tuple[int, ...], tokenizer) -> set[int]:
    """Every id that ends generation: config.json's, generation_config.json's and the tokenizer's EOS."""
    ids = set(config_eos)
    generation = generation_config(model_dir)
    if generation is not None:
        eos = generation.eos_token_id
        ids |= set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


def generation_config(model_dir: str | Path):
    """The directory's `transformers.GenerationConfig`, or None when it has no generation_config.json."""
    from transformers import GenerationConfig
    from transformers.utils import GENERATION_CONFIG_NAME

    # Checked first: transformers raises the same OSError for a missing file as for an unreadable one.
    if not (Path(model_dir) / GENERATION_CONFIG_NAME).is_file():
        return None
    try:
        return GenerationConfig.from_pretrained(str(model_dir), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise DraftsmithError(f"cannot read {GENERATION_CONFIG_NAME} in {model_dir}: {exc}") from None
