"""What every proposer implements; the engine talks to proposers only through this."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from draftsmith.serve.request import Request
from draftsmith.serve.spec.config import SpeculativeConfig


@dataclass
class Drafts:
    tokens: list[list[int]]  # per row, at most the row's max_drafts tokens (possibly none)
    probs: torch.Tensor | None = None  # [B, K, V] draft distributions; None = deterministic (one-hot q)


class Proposer:
    """Drafts tokens for the rows being decoded. Subclasses register with `@register_proposer(name)`."""

    method: str = ""
    # HF hidden_states indices the proposer needs from the target's verify forward (EAGLE: last layer).
    hidden_layer_ids: tuple[int, ...] = ()

    def __init__(self, config: SpeculativeConfig, target, max_num_seqs: int, max_model_len: int):
        self.config = config
        self.k = config.num_speculative_tokens

    def propose(self, rows: list[Request], max_drafts: list[int]) -> Drafts:
        raise NotImplementedError

    def features(self, hidden_states: dict[int, torch.Tensor]) -> torch.Tensor:
        """[B, Q, F] features from a target forward's hidden states (only if `hidden_layer_ids`)."""
        raise NotImplementedError

    def observe(self, request: Request, start: int, features: torch.Tensor) -> None:
        """Target features [m, F] of the request's verified positions start..start+m-1."""

    def release(self, request: Request) -> None:
        """The request finished or was aborted: drop whatever was kept for it."""
