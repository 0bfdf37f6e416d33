"""Choosing a draft token from a head's logits, greedy or sampled, for every proposer that drafts from
logits (EAGLE family, MTP, MLP speculator, Medusa, draft models, DFlash): one rule, so that what a proposer
reports as q is what it sampled from."""

from __future__ import annotations

import torch

from draftsmith.methods.draft_pick_reference import greedy_pick_reference
from draftsmith.models import step_ops_cpu
from draftsmith.models.kernel_backend import draft_pick_wanted


def choose(logits: torch.Tensor, temperature: torch.Tensor | None,
           draws: list[tuple[int, torch.Generator]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """logits [A, V] -> (chosen ids [A] in the logits' vocabulary, probability of each choice [A], q [A, V]
    or None when every row is greedy). Rows whose temperature is 0 take the argmax; `draws` pairs the rows
    that sample with their generators (exponential race: argmax of q / Exp(1) is a draw from q)."""
    if temperature is None:
        return (*pick_greedy(logits), None)
    logits = logits.float()
    argmax = logits.argmax(-1)
    greedy = temperature == 0
    probs = torch.softmax(logits / torch.where(greedy, 1.0, temperature)[:, None], dim=-1)
    noise = torch.ones_like(probs)
    for row, generator in draws:  # each request draws from its own generator: seeded runs repeat
        noise[row].exponential_(generator=generator)
    drawn = torch.where(greedy, argmax, (probs / noise).argmax(-1))
    return drawn, probs.gather(1, drawn[:, None])[:, 0], probs


def pick_greedy(logits: torch.Tensor, d2t: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Every row greedy: (argmax ids [A], mapped by EAGLE-3's `d2t` offsets when given, and the softmax
    probability of each [A]), from one Triton kernel where it runs (CUDA: `draft_pick_triton`, no softmax
    written out), on CPU from one C++ op where the build is loaded (`models.step_ops_cpu`), else PyTorch's."""
    if draft_pick_wanted(logits.device):
        from draftsmith.methods import draft_pick_triton

        return draft_pick_triton.greedy_pick(logits, d2t)
    if logits.dim() == 2 and step_ops_cpu.runs_for(logits):
        return step_ops_cpu.greedy_pick(logits, d2t)
    return greedy_pick_reference(logits, d2t)


def choose_block(logits: torch.Tensor, limits: list[int], rows: torch.Tensor, temperature: torch.Tensor | None,
                 generators: dict[int, torch.Generator], tokens_out: torch.Tensor, probs_out: torch.Tensor | None) -> None:
    """Drafts from one forward's logits [R, W, V] (position j of row r: its draft j + 1; parallel drafting):
    row r keeps its first `limits[r]` and writes them, and q where sampled, to `rows[r]` of the outputs.
    `temperature` [R] (None: all greedy), `generators`: row -> generator of the rows that sample. A row draws
    only for the drafts it keeps, and draft j's q does not depend on drafts 1..j-1 (one forward made them all),
    so each position is chosen on its own."""
    if temperature is None:  # all greedy: one argmax over the block, not a pick (and a softmax) per position
        width = logits.shape[1]
        kept = torch.arange(width, device=logits.device) < torch.tensor(limits, device=logits.device)[:, None]
        tokens_out[rows, :width] = torch.where(kept, step_ops_cpu.argmax_ids(logits), -1)
        return
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
