"""EAGLE-3's draft vocabulary: chosen from the training data, and its maps checked. `d2t[i]` is an offset
(draft id i is target id i + d2t[i]); `t2d` marks the target ids in the draft vocabulary."""

from __future__ import annotations

import torch

from draftsmith.errors import DraftsmithError


def draft_vocab_from_frequencies(ds, vocab_size: int, draft_vocab_size: int) -> torch.Tensor:
    """The `draft_vocab_size` most frequent loss-masked target ids, ascending (EAGLE-3's d2t/t2d source).
    Ties break toward lower ids; fewer distinct tokens than needed are padded with the lowest unused ids."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for record in ds:
        ids = torch.tensor(record["input_ids"])
        counts += torch.bincount(ids[torch.tensor(record["loss_mask"], dtype=torch.bool)], minlength=vocab_size)
    order = sorted(range(vocab_size), key=lambda i: (-int(counts[i]), i))
    return torch.tensor(sorted(order[:draft_vocab_size]), dtype=torch.long)


def check_vocab_maps(d2t: torch.Tensor, t2d: torch.Tensor, vocab: int) -> None:
    """A one-line DraftsmithError unless d2t maps draft ids to ascending target ids inside the vocabulary
    and t2d marks exactly those."""
    d2t = d2t.cpu()
    targets = d2t + torch.arange(len(d2t))
    if len(t2d) != vocab:
        raise DraftsmithError(f"t2d has {len(t2d)} entries but the target vocab size is {vocab}")
    if int(targets.min()) < 0 or int(targets.max()) >= vocab:
        absolute = bool((d2t.diff() > 0).all()) and 0 <= int(d2t.min()) and int(d2t.max()) < vocab
        hint = (": its values look like absolute target ids, where d2t holds offsets (target id = draft id + d2t)"
                if absolute else "")
        raise DraftsmithError(f"d2t maps draft ids to target ids {int(targets.min())}..{int(targets.max())}, "
                              f"outside the target vocab 0..{vocab - 1}{hint}")
    if not torch.equal(torch.nonzero(t2d.cpu()).flatten(), targets):
        raise DraftsmithError("d2t and t2d disagree (t2d must mark exactly the ascending target ids d2t maps to)")
