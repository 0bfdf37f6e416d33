"""Turning logits into tokens: the one place temperature, top-k and top-p are applied.

Speculative verification calls the same `logits_to_probs`, so the target distribution a request samples
from is identical with and without speculation. Sampling uses the exponential race
(argmax p / E, E ~ Exp(1)): no normalization, no `multinomial`, no host sync.

The noise E for the token at sequence position t of a seeded request is drawn from a generator seeded by
(seed, t), not from one stream: the draw does not depend on how many tokens earlier steps produced. Speculation
with deterministic drafts verifies by drawing the target's own token at each drafted position with that same
noise and keeping drafts while they match (accepting x with probability p(x), exactly rejection sampling's
rate for a one-hot q), so a seeded request samples the same tokens with or without speculation, whatever k
each step used.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from draftsmith.models import step_ops_cpu
from draftsmith.serve.engine.logits_processing import DraftPrefix, LogitsAdjust
from draftsmith.serve.engine.sampling_params import SamplingParams


@dataclass
class SamplingBatch:
    """Per-row sampling settings as device tensors, built once per step from the requests' params."""

    temperature: torch.Tensor  # [B] fp32; rows with 0 are greedy
    top_k: torch.Tensor  # [B] long; 0 = off
    top_p: torch.Tensor  # [B] fp32; 1 = off
    generators: list[torch.Generator]
    all_greedy: bool
    needs_filter: bool  # any row uses top-k or top-p (host-known, so the sort is skipped otherwise)
    sampled_rows: list[int]  # rows with temperature > 0, host-known
    seeds: list[int] | None = None  # per row: with `positions`, keys the noise by sequence position
    positions: list[int] | None = None  # per row: sequence position of the next token
    min_p: torch.Tensor | None = None  # [B] fp32, None where no row asks
    adjust: LogitsAdjust | None = None  # penalties, biases and bans (`logits_processing`), None where no row asks

    @classmethod
    def build(cls, params: list[SamplingParams], generators: list[torch.Generator], device,
              seeds: list[int] | None = None, positions: list[int] | None = None,
              adjust: LogitsAdjust | None = None) -> SamplingBatch:
        return cls(
            temperature=torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device),
            top_k=torch.tensor([max(p.top_k, 0) for p in params], dtype=torch.long, device=device),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
            generators=generators,
            all_greedy=all(p.greedy for p in params),
            needs_filter=any(p.top_k > 0 or p.top_p < 1 for p in params),
            sampled_rows=[i for i, p in enumerate(params) if not p.greedy],
            seeds=seeds,
            positions=positions,
            min_p=torch.tensor([p.min_p for p in params], device=device) if any(p.min_p for p in params) else None,
            adjust=adjust,
        )

    def select(self, rows: list[int]) -> SamplingBatch:
        """The settings of `rows` alone, in that order (the engine retries failed batched work row by row)."""
        index = torch.tensor(rows, device=self.temperature.device)
        greedy = [self.temperature[r].item() == 0 for r in rows]
        return SamplingBatch(self.temperature[index], self.top_k[index], self.top_p[index],
                             [self.generators[r] for r in rows], all(greedy), self.needs_filter,
                             [i for i, g in enumerate(greedy) if not g],
                             None if self.seeds is None else [self.seeds[r] for r in rows],
                             None if self.positions is None else [self.positions[r] for r in rows],
                             None if self.min_p is None else self.min_p[index],
                             None if self.adjust is None else self.adjust.select(rows))

    def processed(self, logits: torch.Tensor, prefix: DraftPrefix | None = None) -> torch.Tensor:
        """logits [B, N, V] after the rows' penalties, biases and bans (`logits_processing`); unchanged where
        no row asks. `prefix`: the drafts each position follows, when N > 1."""
        return logits if self.adjust is None else self.adjust.apply(logits, prefix)


def logits_to_probs(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """logits [B, N, V] -> probabilities [B, N, V] after temperature, min_p, top-k and top-p (per row b), in
    vLLM's order.

    Greedy rows get a temperature of 1 here; callers take their argmax instead of sampling.
    """
    temperature = torch.where(batch.temperature > 0, batch.temperature, torch.ones_like(batch.temperature))
    logits = logits / temperature[:, None, None]
    if batch.min_p is not None:
        probs = torch.softmax(logits, dim=-1)
        floor = batch.min_p[:, None, None] * probs.amax(dim=-1, keepdim=True)
        logits = logits.masked_fill(probs < floor, float("-inf"))
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


def position_noise(batch: SamplingBatch, num_positions: int, vocab: int, device) -> torch.Tensor:
    """Exp(1) noise [B, N, V] for the next N positions of each sampled row (greedy rows get 1): from
    generators seeded by (seed, position) when the batch has seeds, else from each row's own stream."""
    noise = torch.ones(len(batch.generators), num_positions, vocab, device=device)
    keyed = _keyed_generator(batch, device)
    for row in batch.sampled_rows:
        for j in range(num_positions):
            noise[row, j].exponential_(generator=_position_generator(batch, row, j, keyed))
    return noise


def verify_noise(batch: SamplingBatch, num_draft: list[int], vocab: int, device) -> torch.Tensor:
    """Exp(1) noise [B, V] for the token a verify step draws per sampled row (greedy rows get 1). A row that
    drafted draws it from its own stream; a row that drafted nothing (at its max_tokens, say, in a batch whose
    other rows draft) draws as a plain step would, keyed by its position: alone, that step is a plain one, and
    a seeded request must sample the same tokens batched or alone."""
    noise = torch.ones(len(batch.generators), vocab, device=device)
    keyed = _keyed_generator(batch, device)
    for row in batch.sampled_rows:
        generator = batch.generators[row] if num_draft[row] else _position_generator(batch, row, 0, keyed)
        noise[row].exponential_(generator=generator)
    return noise


def _keyed_generator(batch: SamplingBatch, device) -> torch.Generator | None:
    """A scratch generator to seed per (request seed, position), when the batch carries seeds."""
    return torch.Generator(device=device) if batch.seeds is not None else None


def _position_generator(batch: SamplingBatch, row: int, offset: int, keyed: torch.Generator | None):
    """Row's generator for the token `offset` past its next position: `keyed` seeded by (seed, position), or
    without seeds the row's own stream."""
    if keyed is None:
        return batch.generators[row]
    return keyed.manual_seed(_mix(batch.seeds[row], batch.positions[row] + offset))


def _mix(seed: int, position: int) -> int:
    """A 63-bit generator seed from (request seed, position); nearby pairs give unrelated streams."""
    x = (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) % 2**64
    x = ((x ^ (x >> 31)) * 0xD6E8FEB86659FD93) % 2**64
    return (x ^ (x >> 29)) % 2**63


def choose_tokens(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Processed logits [B, N, V] (`SamplingBatch.processed`) for N consecutive positions -> the token each
    row samples there [B, N]: argmax for greedy rows, the exponential race over the filtered p with
    position-keyed noise otherwise."""
    greedy = step_ops_cpu.argmax_ids(logits)
    if batch.all_greedy:
        return greedy
    probs = logits_to_probs(logits, batch)
    drawn = (probs / position_noise(batch, logits.shape[1], logits.shape[-1], probs.device)).argmax(dim=-1)
    return torch.where(batch.temperature[:, None] > 0, drawn, greedy)


def sample(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """The target's logits [B, V] at each row's next position -> token ids [B]: argmax for greedy rows, a
    draw from the filtered p otherwise, after the rows' processing."""
    return choose_tokens(batch.processed(logits[:, None]), batch)[:, 0]
