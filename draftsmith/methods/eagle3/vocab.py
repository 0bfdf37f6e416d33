"""Choosing EAGLE-3's draft vocabulary from the training data."""

from __future__ import annotations

import torch


def draft_vocab_from_frequencies(ds, vocab_size: int, draft_vocab_size: int) -> torch.Tensor:
    """The `draft_vocab_size` most frequent loss-masked target ids, ascending (EAGLE-3's d2t/t2d source).
    Ties break toward lower ids; fewer distinct tokens than needed are padded with the lowest unused ids."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for record in ds:
        ids = torch.tensor(record["input_ids"])
        counts += torch.bincount(ids[torch.tensor(record["loss_mask"], dtype=torch.bool)], minlength=vocab_size)
    order = sorted(range(vocab_size), key=lambda i: (-int(counts[i]), i))
    return torch.tensor(sorted(order[:draft_vocab_size]), dtype=torch.long)
