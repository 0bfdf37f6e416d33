"""IBM's MLP speculator (fms-extras): n_predict stages, each mixing the running state with the embedding of
the last token, then an RMS-style norm with scale and shift, GELU, and a stage LM head. Stage i drafts token
t + 2 + i; its input token is stage i - 1's draft (the target's own next token for stage 0). The state starts
as the target's final normed hidden state at t (`scale_input`: normed again without weights, / sqrt 2).

    state = proj[i](state) + (emb_weight / state_weight) * emb[i](token)
    state = GELU(ln[i](state)),  logits_i = head[i](state)

with state_weight = 0.5 ** (0.5 / n_predict) and emb_weight = sqrt((1 - state_weight^2) * inner_dim / 2).
Tied speculators share emb, head and ln of stage 0 and proj of stage 1 (from stage 1 on). Key names are
the native ones `draftsmith convert` writes (`emb.i`, `proj.i`, `head.i`, `ln.i`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from draftsmith.models.head_configs import MLPSpeculatorConfig
from draftsmith.models.heads import FinalHiddenHead
from draftsmith.models.linear import Linear

EPS = 1e-6  # fms LayerNormParameterized's default


def _rms_normalized(x: torch.Tensor) -> torch.Tensor:
    """x rsqrt(mean(x^2) + EPS), with fp32 statistics, in x's dtype."""
    return (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype)


class StageNorm(nn.Module):
    """fms's LayerNormParameterized as the speculator uses it: no mean subtraction, then scale and shift."""

    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _rms_normalized(x) * self.weight + self.bias


class MLPSpeculatorHead(FinalHiddenHead):
    head_type = "mlp_speculator"

    def __init__(self, config: MLPSpeculatorConfig):
        super().__init__(config)
        n, inner, tied = config.n_predict, config.inner_dim or config.emb_dim, config.tie_weights
        own = 1 if tied else n
        self.emb = nn.ModuleList(nn.Embedding(config.vocab_size, inner) for _ in range(own))
        self.proj = nn.ModuleList(Linear(config.emb_dim if i == 0 else inner, inner, bias=False)
                                  for i in range(min(n, 2) if tied else n))
        self.head = nn.ModuleList(Linear(inner, config.vocab_size, bias=False) for _ in range(own))
        self.ln = nn.ModuleList(StageNorm(inner) for _ in range(own))
        state_weight = 0.5 ** (0.5 / n)
        self.emb_scale = math.sqrt((1 - state_weight**2) * inner / 2) / state_weight

    @torch.no_grad()
    def init_from_target(self) -> None:
        """A training start as fms-extras makes it (every embedding and linear weight N(0, 1/sqrt(inner_dim)),
        norms the identity), except that where the stages are as wide as the target, each stage's head starts
        as the target's LM head, as Medusa starts."""
        inner = self.config.inner_dim or self.config.emb_dim
        for module in [*self.proj, *self.head, *self.emb]:
            module.weight.normal_(0, inner**-0.5)
        for norm in self.ln:
            norm.weight.fill_(1.0)
            norm.bias.zero_()
        if inner == self.target.config.hidden_size:
            for head in self.head:
                head.weight.copy_(self.target.lm_head.weight.float())

    def start(self, hidden: torch.Tensor) -> torch.Tensor:
        """The state stage 0 reads, from the target's final normed hidden state."""
        if not self.config.scale_input:
            return hidden
        return _rms_normalized(hidden) / math.sqrt(2)

    def stage(self, i: int, state: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Stage i: (its state, its logits [..., V]) from the previous state and the last token's ids."""
        own = 0 if self.config.tie_weights else i
        proj = self.proj[min(i, 1) if self.config.tie_weights else i]
        state = proj(state) + self.emb_scale * self.emb[own](tokens).to(state.dtype)
        state = F.gelu(self.ln[own](state))
        return state, self.head[own](state)

    def forward(self, hidden: torch.Tensor, tokens: torch.Tensor, stages: int | None = None) -> torch.Tensor:
        """Teacher-forced: hidden [..., H] and tokens [..., n] (the token each stage reads) -> logits
        [..., stages, V]."""
        state, out = self.start(hidden), []
        for i in range(stages or self.config.n_predict):
            state, logits = self.stage(i, state, tokens[..., i])
            out.append(logits.float())
        return torch.stack(out, dim=-2)
