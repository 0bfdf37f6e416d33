"""Verification: one target forward scored k+1 positions; decide what each row keeps.

The sampler implementation is chosen once per engine: the Triton kernel on CUDA (when Triton is
installed), the PyTorch reference elsewhere.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from draftsmith.methods.proposer_base import DraftBatch
from draftsmith.serve.engine.logits_processing import DraftPrefix
from draftsmith.serve.engine.sampling import SamplingBatch, choose_tokens, logits_to_probs, verify_noise
from draftsmith.serve.speculation.rejection_reference import rejection_sample_reference
from draftsmith.serve.speculation.rejection_triton import rejection_sample_triton, triton

SAMPLERS: dict[str, Callable] = {"torch": rejection_sample_reference, "triton": rejection_sample_triton}


def pick_sampler(device: torch.device) -> Callable:
    return SAMPLERS["triton" if device.type == "cuda" and triton is not None else "torch"]


@dataclass
class SpecMetrics:
    """vLLM's counters: a draft is one row proposing >= 1 token in one step."""

    num_speculative_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    # drafts that reached each position: a row drafts fewer than k near its max_tokens or context end, so a
    # position's acceptance rate is accepted / drafted there, not accepted / num_drafts
    drafted_per_position: list[int] = field(default_factory=list)

    def __post_init__(self):
        self.reset()

    def reset(self) -> None:
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        self.accepted_per_position = [0] * self.num_speculative_tokens
        self.drafted_per_position = [0] * self.num_speculative_tokens

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        if num_draft_tokens == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1
        for position in range(num_draft_tokens):
            self.drafted_per_position[position] += 1

    def as_dict(self) -> dict:
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "accepted_per_position": list(self.accepted_per_position),
            "drafted_per_position": list(self.drafted_per_position),
            "mean_acceptance_length": 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0,
            "draft_acceptance_rate": self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0,
        }


def verified_tokens(logits: torch.Tensor, drafts: DraftBatch, num_draft: list[int], sampling: SamplingBatch,
                    sampler: Callable, synthetic_rate: float | None,
                    host_drafts: list[list[int]] | None = None) -> list[list[int]]:
    """What `verify` keeps, per row as a host list: the accepted drafts, then the new token. On CPU, drafts
    without a q are matched on the host: the target's choices and the drafts are a few ints a row, and the
    dozen small tensor ops of matching them as tensors took 0.15-0.2 ms a step. `host_drafts`: each row's
    drafts (at least its count) where the caller already listed them."""
    if drafts.probs is None and synthetic_rate is None and logits.device.type == "cpu":
        logits, draft_tokens, k = _scored(logits, drafts, num_draft, sampling)
        choices = choose_tokens(logits, sampling).tolist()
        kept = []
        listed = host_drafts if host_drafts is not None else draft_tokens.tolist()
        for choice, row_drafts, count in zip(choices, listed, num_draft):
            accepted = 0
            while accepted < count and row_drafts[accepted] == choice[accepted]:
                accepted += 1
            kept.append(row_drafts[:accepted] + [choice[accepted]])
        return kept
    tokens, counts = verify(logits, drafts, num_draft, sampling, sampler, synthetic_rate)
    packed = torch.cat([tokens, counts[:, None]], dim=1).tolist()  # one device-to-host copy for both
    return [row[: row[-1]] for row in packed]


def _scored(logits: torch.Tensor, drafts: DraftBatch, num_draft: list[int],
            sampling: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor, int]:
    """-> (the k + 1 scored positions' logits [B, k + 1, V] after the rows' processing, the drafts [B, k]
    (-1 padding) on the logits' device, k: the most any row drafted, at least 1)."""
    k = max(1, max(num_draft))
    logits = logits[:, : k + 1]
    if logits.shape[1] < k + 1:  # every row drafted fewer than the padded width
        logits = torch.nn.functional.pad(logits, (0, 0, 0, k + 1 - logits.shape[1]))
    draft_tokens = _width(drafts.tokens, k, -1).to(logits.device)
    if sampling.adjust is not None:
        # position j is read only when drafts 0..j-1 were accepted: processed as if they were output
        logits = sampling.processed(logits, DraftPrefix.chain(draft_tokens, k + 1))
    return logits, draft_tokens, k


def verify(logits: torch.Tensor, drafts: DraftBatch, num_draft: list[int], sampling: SamplingBatch,
           sampler: Callable, synthetic_rate: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, Q, V] for [last token, drafts...] -> (tokens [B, K + 1], count [B]): per row the accepted
    drafts plus one new token, -1 after them. `num_draft` is `drafts.counts` as the host already holds it
    (it sized the forward); the draft tensors themselves are consumed on the device as they are."""
    device = logits.device
    rows, vocab = logits.shape[0], logits.shape[-1]
    logits, draft_tokens, k = _scored(logits, drafts, num_draft, sampling)
    counts = drafts.counts.to(device)
    if drafts.probs is None and synthetic_rate is None:
        return keep_matching(choose_tokens(logits, sampling), draft_tokens, counts)
    target_argmax = logits.argmax(dim=-1)
    is_greedy = sampling.temperature == 0
    draft_probs = None
    if sampling.all_greedy and synthetic_rate is None:
        probs = logits  # greedy rows read only target_argmax; skip the softmax
        uniforms = torch.zeros(rows, k, device=device)
        noise = torch.ones(rows, vocab, device=device)
    else:
        probs = logits_to_probs(logits, sampling)
        # Each row draws from its own generator, and only as much as it drafted: seeded runs repeat.
        uniforms = torch.zeros(rows, k, device=device)
        for row, (g, n) in enumerate(zip(sampling.generators, num_draft)):
            if n:
                uniforms[row, :n] = torch.rand(n, generator=g, device=device)
        noise = verify_noise(sampling, num_draft, vocab, device)
        if drafts.probs is not None:
            draft_probs = _width(drafts.probs, k, 0.0).to(device)
    return sampler(probs, target_argmax, draft_tokens, counts, draft_probs, uniforms, noise, is_greedy, synthetic_rate)


def keep_matching(choice: torch.Tensor, draft_tokens: torch.Tensor, counts: torch.Tensor):
    """Deterministic drafts: choice [B, K + 1] is the token the target samples at each position (with the
    noise plain decoding would use there); drafts are kept while they equal it, and the first differing
    choice, or the one after the last draft, is the new token. Same (tokens, count) shape as the sampler."""
    k = draft_tokens.shape[1]
    positions = torch.arange(k, device=choice.device)
    match = (draft_tokens == choice[:, :k]) & (positions[None, :] < counts[:, None])
    num_accepted = match.to(torch.long).cumprod(dim=1).sum(dim=1)
    out = torch.where(positions[None, :] < num_accepted[:, None], draft_tokens, torch.full_like(draft_tokens, -1))
    out = torch.cat([out, torch.full_like(out[:, :1], -1)], dim=1)
    rows = torch.arange(choice.shape[0], device=choice.device)
    out[rows, num_accepted] = choice[rows, num_accepted]
    return out, num_accepted + 1


def _width(t: torch.Tensor, k: int, fill) -> torch.Tensor:
    """t [B, K', ...] cut or padded with `fill` to [B, k, ...]."""
    if t.shape[1] >= k:
        return t[:, :k]
    pad = torch.full((t.shape[0], k - t.shape[1], *t.shape[2:]), fill, dtype=t.dtype, device=t.device)
    return torch.cat([t, pad], dim=1)
