"""Choosing a draft token from a head's logits, greedy or sampled, for every proposer that drafts from
logits (EAGLE family, MTP, MLP speculator, Medusa, draft models, DFlash): one rule, so that what a proposer
reports as q is what it sampled from."""

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


def choose_block(logits: torch.Tensor, limits: list[int], rows: torch.Tensor, temperature: torch.Tensor | None,
                 generators: dict[int, torch.Generator], tokens_out: torch.Tensor, probs_out: torch.Tensor | None) -> None:
    """Drafts from one forward's logits [R, W, V] (position j of row r: its draft j + 1; parallel drafting):
    row r keeps its first `limits[r]` and writes them, and q where sampled, to `rows[r]` of the outputs.
    `temperature` [R] (None: all greedy), `generators`: row -> generator of the rows that sample. A row draws
    only for the drafts it keeps, and draft j's q does not depend on drafts 1..j-1 (one forward made them all),
    so each position is chosen on its own."""
    for step in range(logits.shape[1]):
        live = [r for r, limit in enumerate(limits) if limit > step]
        if not live:
            break
        live_t = torch.tensor(live, device=logits.device)
        draws = [(i, generators[r]) for i, r in enumerate(live) if r in generators]
        drawn, _, q = choose(logits[live_t, step], None if temperature is None else temperature[live_t], draws)
        tokens_out[rows[live_t], step] = drawn
        if probs_out is not None:
            probs_out[rows[live_t], step] = q
