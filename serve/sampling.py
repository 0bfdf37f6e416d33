"""Turning logits into tokens: the one place temperature, top-k and top-p are applied.

Speculative verification calls the same `logits_to_probs`, so the target distribution a request samples
from is identical with and without speculation. Sampling uses the exponential race
(argmax p / E, E ~ Exp(1)): no normalization, no `multinomial`, no host sync.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from draftsmith.serve.sampling_params import SamplingParams


@dataclass
class SamplingBatch:
    """Per-row sampling settings as device tensors, built once per step from the requests' params."""

    temperature: torch.Tensor  # [B] fp32; rows with 0 are greedy
    top_k: torch.Tensor  # [B] long; 0 = off
    top_p: torch.Tensor  # [B] fp32; 1 = off
    generators: list[torch.Generator]
    all_greedy: bool
    needs_filter: bool  # any row uses top-k or top-p (host-known, so the sort is skipped otherwise)

    @classmethod
    def build(cls, params: list[SamplingParams], generators: list[torch.Generator], device) -> SamplingBatch:
        return cls(
            temperature=torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device),
            top_k=torch.tensor([max(p.top_k, 0) for p in params], dtype=torch.long, device=device),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
            generators=generators,
            all_greedy=all(p.greedy for p in params),
            needs_filter=any(p.top_k > 0 or p.top_p < 1 for p in params),
        )


def logits_to_probs(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """logits [B, N, V] -> probabilities [B, N, V] after temperature, top-k and top-p (per row b).

    Greedy rows get a temperature of 1 here; callers take their argmax instead of sampling.
    """
    temperature = torch.where(batch.temperature > 0, batch.temperature, torch.ones_like(batch.temperature))
    logits = logits / temperature[:, None, None]
    if batch.needs_filter:
        logits = _filter_top_k_top_p(logits, batch.top_k, batch.top_p)
    return torch.softmax(logits, dim=-1)


def _filter_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device)
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab))
    drop = ranks[None, None, :] >= k[:, None, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    # Keep the smallest prefix whose mass reaches top_p; the most likely token always survives.
    mass_before = probs.cumsum(dim=-1) - probs
    drop = mass_before >= top_p[:, None, None]
    drop[..., 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


def exponential_noise(shape_per_row: tuple[int, ...], batch: SamplingBatch, device) -> torch.Tensor:
    """Exp(1) noise [B, *shape_per_row], row b drawn from request b's own generator."""
    return torch.stack([
        torch.empty(shape_per_row, device=device).exponential_(generator=g) for g in batch.generators
    ])


def sample(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """logits [B, V] -> token ids [B]: argmax for greedy rows, a draw from the filtered p otherwise."""
    greedy = logits.argmax(dim=-1)
    if batch.all_greedy:
        return greedy
    probs = logits_to_probs(logits[:, None], batch)[:, 0]
    drawn = (probs / exponential_noise(probs.shape[1:], batch, probs.device)).argmax(dim=-1)
    return torch.where(batch.temperature > 0, drawn, greedy)
