"""Medusa-1 heads: K parallel heads over the target's final normed hidden state at position t; head i
predicts token t + 2 + i (the target's own LM head predicts t + 1). Each head is `num_layers` ResBlocks
(x + SiLU(W x + b)) and an LM head of its own, or the target's (`own_lm_heads` false). Key names are vLLM's
(`blocks.{i}.layers.{j}`, `lm_heads.{i}`), as `draftsmith convert` writes them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from draftsmith.models.head_configs import MedusaConfig
from draftsmith.models.heads import FinalHiddenHead
from draftsmith.models.linear import Linear


class ResBlock(Linear):
    """x + SiLU(W x + b); a Linear itself, so its tensors are `weight` and `bias` as vLLM names them."""

    def __init__(self, hidden: int):
        super().__init__(hidden, hidden, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(super().forward(x))


class _Block(nn.Module):
    def __init__(self, hidden: int, layers: int):
        super().__init__()
        self.layers = nn.ModuleList(ResBlock(hidden) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class MedusaHead(FinalHiddenHead):
    head_type = "medusa"

    def __init__(self, config: MedusaConfig):
        super().__init__(config)
        self.blocks = nn.ModuleList(_Block(config.hidden_size, config.num_layers) for _ in range(config.num_heads))
        if config.own_lm_heads:
            self.lm_heads = nn.ModuleList(Linear(config.hidden_size, config.vocab_size, bias=False)
                                          for _ in range(config.num_heads))

    def forward(self, hidden: torch.Tensor, heads: int | None = None) -> torch.Tensor:
        """hidden [..., H] -> logits [..., heads, V] of the first `heads` heads (all by default). Heads reading
        out through the target's LM head share one call of it over their stacked outputs: the LM head is
        most of what a head reads, and a call reads it once for all its rows."""
        count = heads or self.config.num_heads
        if not self.config.own_lm_heads:
            lm_head = self.target.lm_head
            states = torch.stack([self.blocks[i](hidden) for i in range(count)], dim=-2)
            return lm_head(states.to(lm_head.weight.dtype)).float()
        outs = [self.lm_heads[i](self.blocks[i](hidden).to(self.lm_heads[i].weight.dtype)).float()
                for i in range(count)]
        return torch.stack(outs, dim=-2)

    @torch.no_grad()
    def init_from_target(self) -> None:
        """Medusa's initialization: every ResBlock the identity (zero weights) and every LM head a copy of the
        target's, so that each head starts out predicting what the target predicts next."""
        for block in self.blocks:
            for layer in block.layers:
                layer.weight.zero_()
                layer.bias.zero_()
        if self.config.own_lm_heads:
            for lm_head in self.lm_heads:
                lm_head.weight.copy_(self.target.lm_head.weight.float())
