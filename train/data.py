"""Training data: HF `datasets` loading of chat or plain-text JSONL, chat templating, assistant-only masks.

Chat records: `{"messages": [{"role", "content"}, ...]}` (OpenAI) or `{"conversations": [{"from", "value"}]}`
(ShareGPT; human/gpt/system map to user/assistant/system). Text records: `{"text": ...}` (code files).
A token's loss mask is 1 where the head should learn to predict it: every token of plain text (with
`mask_prompt`, only the tokens after a regenerated record's `prompt`), and only the assistant turns (content
and end-of-turn marker) of chat data, found through the tokenizer's offsets.
"""

from __future__ import annotations

from typing import Any

import torch

from draftsmith.corpus import detect_format, to_messages
from draftsmith.errors import DraftsmithError


def tokenize_text(text: str, tokenizer, max_length: int, prompt: str | None = None) -> dict[str, list[int]]:
    """`prompt`: a prefix of `text` whose tokens are not learned (a token straddling its end is)."""
    if prompt is None:
        ids = tokenizer(text, add_special_tokens=False, truncation=True, max_length=max_length).input_ids
        return {"input_ids": ids, "loss_mask": [1] * len(ids)}
    if not text.startswith(prompt):
        raise DraftsmithError("a text record's 'prompt' is not the start of its 'text'")
    encoded = tokenizer(text, add_special_tokens=False, truncation=True, max_length=max_length,
                        return_offsets_mapping=True)
    return {"input_ids": encoded.input_ids, "loss_mask": [int(end > len(prompt)) for _, end in encoded.offset_mapping]}


def tokenize_chat(messages: list[dict[str, str]], tokenizer, max_length: int) -> dict[str, list[int]]:
    """Renders with the target's chat template; masks in the assistant spans found by re-rendering prefixes."""
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True) if i else ""
        through = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False)
        if not text.startswith(through) or not through.startswith(before):
            raise DraftsmithError("the chat template does not render conversations prefix by prefix; "
                                  "cannot locate assistant turns")
        spans.append((len(before), len(through)))
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, truncation=True,
                        max_length=max_length)
    mask = [int(any(lo <= start and end <= hi for lo, hi in spans)) for start, end in encoded.offset_mapping]
    return {"input_ids": encoded.input_ids, "loss_mask": mask}


def tokenize_dataset(ds, tokenizer, max_length: int, data_format: str = "auto", mask_prompt: bool = False):
    """`mask_prompt`: text records learn only what follows their 'prompt' (an error where they have none)."""
    data_format = detect_format(ds.column_names) if data_format == "auto" else data_format
    if mask_prompt and (data_format != "text" or "prompt" not in ds.column_names):
        raise DraftsmithError("data.mask_prompt needs text records with a 'prompt' field (as `draftsmith datagen` "
                              f"writes them); these have {sorted(ds.column_names)}")

    def encode(record):
        if data_format == "chat":
            return tokenize_chat(to_messages(record), tokenizer, max_length)
        return tokenize_text(record["text"], tokenizer, max_length, record["prompt"] if mask_prompt else None)

    ds = ds.map(encode, remove_columns=ds.column_names, desc="tokenizing")
    return ds.filter(lambda r: len(r["input_ids"]) > 2 and sum(r["loss_mask"]) > 0)


def check_tokenizer(tokenizer, vocab_size: int, reference_tokenizer=None) -> None:
    """The data must be tokenized the way the target reads it."""
    if len(tokenizer) > vocab_size:
        raise DraftsmithError(f"tokenizer has {len(tokenizer)} tokens but the target's vocab_size is {vocab_size}")
    if reference_tokenizer is not None and tokenizer.get_vocab() != reference_tokenizer.get_vocab():
        raise DraftsmithError("the data tokenizer differs from the target's tokenizer")


def collate(records: list[dict[str, Any]], pad_id: int = 0) -> dict[str, torch.Tensor]:
    """Right-padded batch; padding has loss mask 0 and sits after every real token (causal attention)."""
    width = max(len(r["input_ids"]) for r in records)
    ids = torch.full((len(records), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(records), width, dtype=torch.long)
    for i, r in enumerate(records):
        n = len(r["input_ids"])
        ids[i, :n] = torch.tensor(r["input_ids"])
        mask[i, :n] = torch.tensor(r["loss_mask"])
    batch = {"input_ids": ids, "loss_mask": mask, "lengths": torch.tensor([len(r["input_ids"]) for r in records])}
    for key in ("features", "last"):  # offline (captured) hidden states, padded like the ids
        if key in records[0]:
            dim = records[0][key].shape[-1]
            padded = torch.zeros(len(records), width, dim, dtype=records[0][key].dtype)
            for i, r in enumerate(records):
                padded[i, : len(r[key])] = r[key]
            batch[key] = padded
    return batch
