"""DSpark (deepseek-ai/DeepSpec, 2026): a DFlash block drafter (`methods.dflash.head`) in the anchor-first
layout, plus two small heads:
- a low-rank **Markov head**: block position k's logits gain `markov_w2(markov_w1[x_{k-1}])`, a rank-r bigram
  term of the token before it (the block's anchor for position 0, the previous draft after that), so later
  drafts follow the ones before them instead of each being the block's marginal guess.
  With `markov_head_type` "gated" (DeepSpec's variant) the rank-r embedding is scaled, component by
  component, by `sigmoid(gate_proj([h_k, markov_w1[x_{k-1}]]))` before `markov_w2`: which parts of the token's
  transitions apply depends on the block position's hidden state, so the term is no longer one bigram table;
- a **confidence head**: `sigmoid(proj([h_k, markov_w1[x_{k-1}]]))`, the chance that draft k is accepted
  given that drafts 0..k-1 were; the product along the block is the chance a prefix survives, which is
  what the server sizes each row's verify by.
Parameter names are DeepSpec's (`markov_head.markov_w1`, `markov_head.markov_w2`, `confidence_head.proj`),
so its checkpoints and ours differ in config only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from draftsmith.errors import DraftsmithError
from draftsmith.methods.dflash.head import DFlashConfig, DFlashHead

MARKOV_HEAD_TYPES = ("vanilla", "gated")


@dataclass
class DSparkConfig(DFlashConfig):
    head_type: ClassVar[str] = "dspark"
    markov_rank: int = 256  # 0: no Markov head (DeepSpec's DFlash baseline)
    markov_head_type: str = "vanilla"  # DeepSpec's: vanilla (a rank-r bigram) or gated (scaled by the hidden state)
    enable_confidence_head: bool = True
    confidence_head_with_markov: bool = True  # the confidence head also reads markov_w1 of the token before
    sample_from_anchor: bool = True  # DSpark's layout: block position k drafts the token after it

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.sample_from_anchor:
            raise DraftsmithError("a DSpark head is anchor-first (sample_from_anchor true): its Markov term reads "
                                  "the token before each block position, the anchor for the first")
        if self.markov_head_type not in MARKOV_HEAD_TYPES:
            raise DraftsmithError(f"DSpark markov_head_type {self.markov_head_type!r}: one of "
                                  f"{', '.join(MARKOV_HEAD_TYPES)} (DeepSpec's rnn head is not implemented)")
        if self.markov_rank < 0:
            raise DraftsmithError(f"DSpark markov_rank {self.markov_rank}: 0 (none) or more")
        if self.confidence_head_with_markov and self.enable_confidence_head and not self.markov_rank:
            raise DraftsmithError("confidence_head_with_markov needs a Markov head (markov_rank > 0)")


class MarkovHead(nn.Module):
    def __init__(self, vocab_size: int, rank: int, gate_width: int | None = None):
        """`gate_width`: the hidden size of the block positions whose state gates the term (DeepSpec's gated
        head), None for the vanilla head."""
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)
        self.gate_proj = nn.Linear(gate_width + rank, rank) if gate_width else None
        nn.init.normal_(self.markov_w1.weight, std=0.02)
        nn.init.zeros_(self.markov_w2.weight)  # starts as the DFlash head it is built on

    @property
    def gated(self) -> bool:
        return self.gate_proj is not None

    def embed(self, previous: torch.Tensor) -> torch.Tensor:
        """Token ids [...] -> their rank-r embeddings [..., r] (what the confidence head reads)."""
        return self.markov_w1(previous)

    def latent(self, embedded: torch.Tensor, hidden: torch.Tensor | None) -> torch.Tensor:
        """The rank-r vectors `markov_w2` maps to the bias: the embeddings themselves, or, gated, scaled by
        `sigmoid(gate_proj([hidden, embedded]))` of the positions' hidden states [..., H]."""
        if self.gate_proj is None:
            return embedded
        if hidden is None:
            raise DraftsmithError("a gated Markov head reads the block positions' hidden states")
        gate = torch.sigmoid(self.gate_proj(torch.cat([hidden.to(embedded.dtype), embedded], dim=-1)))
        return gate.to(embedded.dtype) * embedded

    def forward(self, previous: torch.Tensor, hidden: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids [...] (and, gated, the hidden states [..., H] of the positions after them) -> (their rank-r
        embeddings [..., r], the logit bias they give the next position [..., V] in fp32)."""
        embedded = self.embed(previous)
        return embedded, self.markov_w2(self.latent(embedded, hidden)).float()


class ConfidenceHead(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.proj = nn.Linear(width, 1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """[..., width] -> the acceptance logit of each position [...] in fp32."""
        return self.proj(features.to(self.proj.weight.dtype)).float()[..., 0]


class DSparkHead(DFlashHead):
    head_type = "dspark"

    def __init__(self, config: DSparkConfig):
        super().__init__(config)
        gate_width = config.hidden_size if config.markov_head_type == "gated" else None
        self.markov_head = MarkovHead(config.vocab_size, config.markov_rank, gate_width) if config.markov_rank else None
        self.confidence_head = None
        if config.enable_confidence_head:
            width = config.hidden_size + (config.markov_rank if config.confidence_head_with_markov else 0)
            self.confidence_head = ConfidenceHead(width)

    def markov(self, previous: torch.Tensor, hidden: torch.Tensor | None = None) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(rank-r embeddings or None, logit bias [..., V] or 0.0) of the tokens before some block positions,
        whose final hidden states [..., H] a gated head reads."""
        if self.markov_head is None:
            return None, torch.zeros((), device=previous.device)
        return self.markov_head(previous, hidden)

    def confidence_logits(self, hidden: torch.Tensor, embedded: torch.Tensor | None) -> torch.Tensor:
        """Block positions' final hidden states [..., H] and the Markov embeddings of the tokens before them
        -> acceptance logits [...]: sigmoid is the chance the position is accepted given the ones before."""
        if self.confidence_head is None:
            raise DraftsmithError("this DSpark head has no confidence head (enable_confidence_head false)")
        features = hidden
        if self.config.confidence_head_with_markov:
            features = torch.cat([hidden, embedded.to(hidden.dtype)], dim=-1)
        return self.confidence_head(features)
