"""Choosing a draft token from a head's logits, greedy or sampled, for every proposer that drafts from
logits (EAGLE family, MTP, MLP speculator, Medusa): one rule, so that what a proposer reports as q is what
it sampled from."""

from __future__ import annotations

import torch


def choose(logits: torch.Tensor, temperature: torch.Tensor | None,
           draws: list[tuple[int, torch.Generator]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """logits [A, V] -> (chosen ids [A] in the logits' vocabulary, probability of each choice [A], q [A, V]
    or None when every row is greedy). Rows whose temperature is 0 take the argmax; `draws` pairs the rows
    that sample with their generators (exponential race: argmax of q / Exp(1) is a draw from q)."""
    logits = logits.float()
    if temperature is None:  # one fused softmax gives the argmax and its probability together
        top, argmax = torch.softmax(logits, dim=-1).max(-1)
        return argmax, top, None
    argmax = logits.argmax(-1)
    greedy = temperature == 0
    probs = torch.softmax(logits / torch.where(greedy, 1.0, temperature)[:, None], dim=-1)
    noise = torch.ones_like(probs)
    for row, generator in draws:  # each request draws from its own generator: seeded runs repeat
        noise[row].exponential_(generator=generator)
    drawn = torch.where(greedy, argmax, (probs / noise).argmax(-1))
    return drawn, probs.gather(1, drawn[:, None])[:, 0], probs
