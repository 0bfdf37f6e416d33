"""What `greedy_pick` (the Triton kernel in draft_pick_triton.py) computes, in plain PyTorch: a greedy draft
step's choice from a head's logits, as a target token id, with its probability (the confidence the adaptive
policy and dynamic stop read)."""

from __future__ import annotations

import torch


def greedy_pick_reference(logits: torch.Tensor, d2t: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [A, V] over the draft vocabulary; d2t [V] (EAGLE-3: draft id i is target id i + d2t[i]) or None
    -> (target ids [A] int64, softmax probability of each pick [A] fp32). The first index wins a tie."""
    top, argmax = torch.softmax(logits.float(), dim=-1).max(-1)
    return (argmax if d2t is None else argmax + d2t[argmax]), top
