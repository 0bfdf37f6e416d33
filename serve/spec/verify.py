"""Verification: one target forward scored k+1 positions; decide what each row keeps.

The sampler implementation is chosen once per engine: the Triton kernel on CUDA (when Triton is
installed), the PyTorch reference elsewhere.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from draftsmith.serve.sampling import SamplingBatch, exponential_noise, logits_to_probs
from draftsmith.serve.spec.proposer import Drafts
from draftsmith.serve.spec.rejection_reference import rejection_sample_reference
from draftsmith.serve.spec.rejection_triton import rejection_sample_triton, triton

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

    def __post_init__(self):
        self.reset()

    def reset(self) -> None:
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        self.accepted_per_position = [0] * self.num_speculative_tokens

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        if num_draft_tokens == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1

    def as_dict(self) -> dict:
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "accepted_per_position": list(self.accepted_per_position),
            "mean_acceptance_length": 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0,
            "draft_acceptance_rate": self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0,
        }


def verify(logits: torch.Tensor, drafts: Drafts, sampling: SamplingBatch, sampler: Callable,
           probabilistic: bool, synthetic_rate: float | None) -> list[list[int]]:
    """logits [B, Q, V] for [last token, drafts...] -> per row the accepted drafts plus one new token."""
    device = logits.device
    rows, vocab = logits.shape[0], logits.shape[-1]
    k = max(1, max(len(d) for d in drafts.tokens))
    logits = logits[:, : k + 1]
    if logits.shape[1] < k + 1:  # every row drafted fewer than the padded width
        logits = torch.nn.functional.pad(logits, (0, 0, 0, k + 1 - logits.shape[1]))
    draft_tokens = torch.full((rows, k), -1, dtype=torch.long)
    for row, tokens in enumerate(drafts.tokens):
        draft_tokens[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
    num_draft = torch.tensor([len(t) for t in drafts.tokens], dtype=torch.long, device=device)
    draft_tokens = draft_tokens.to(device)
    target_argmax = logits.argmax(dim=-1)
    is_greedy = sampling.temperature == 0
    if sampling.all_greedy and synthetic_rate is None:
        probs = logits  # greedy rows read only target_argmax; skip the softmax
        uniforms = torch.zeros(rows, k, device=device)
        noise = torch.ones(rows, vocab, device=device)
    else:
        probs = logits_to_probs(logits, sampling)
        # Each row draws from its own generator, and only as much as it drafted: seeded runs repeat.
        uniforms = torch.zeros(rows, k, device=device)
        for row, (g, tokens) in enumerate(zip(sampling.generators, drafts.tokens)):
            if tokens:
                uniforms[row, : len(tokens)] = torch.rand(len(tokens), generator=g, device=device)
        noise = exponential_noise((vocab,), sampling, device)
    draft_probs = drafts.probs if probabilistic else None
    out, num_out = sampler(probs, target_argmax, draft_tokens, num_draft, draft_probs, uniforms, noise,
                           is_greedy, synthetic_rate)
    out, num_out = out.tolist(), num_out.tolist()  # the step's one device-to-host copy
    return [row[:n] for row, n in zip(out, num_out)]
