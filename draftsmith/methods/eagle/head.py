"""EAGLE-1/2 head: fc over [embedding of token t+1; target feature at t], one decoder layer, target's LM head.
Its one variant is a sliding attention window (`sliding_window`), in training, serving and vLLM's layout alike.

The feature is the target's final-normed hidden state (HF hidden_states[L]), which is what the frozen LM
head reads, so the head's output (a predicted next feature) goes straight to that LM head. Key names follow
the yuhuili checkpoints (`fc`, `layers.0.*`) so conversion is a copy.
"""

from __future__ import annotations

import torch
from torch import nn

from draftsmith.models.draft_layer import DraftDecoderLayer
from draftsmith.models.draft_step_cpu import FusedStepParts
from draftsmith.models.heads import DraftHead, DraftHeadConfig
from draftsmith.models.linear import Linear


class EagleHead(DraftHead):
    head_type = "eagle"
    default_fc_bias = True  # yuhuili's constructor default; LLaMA-3 heads were trained without it
    reads_out_through_target = True
    variants = ("sliding_window",)

    def __init__(self, config: DraftHeadConfig):
        super().__init__(config)
        h = config.hidden_size
        self.fc = Linear(2 * h, h, bias=config.fc_bias)
        self.layers = nn.ModuleList([DraftDecoderLayer(h, h, config.intermediate_size, config.num_attention_heads,
                                                       config.num_key_value_heads, config.head_dim,
                                                       config.rms_norm_eps, attention_bias=config.attention_bias,
                                                       window=config.sliding_window)])

    def fused_step_parts(self) -> FusedStepParts | None:
        """What `models.draft_step_cpu` runs `step` from at one query a row (drafts 2..k) as one op: fc over
        [embedding; state], the layer, the target's LM head; None where the readout casts."""
        layer = self.layers[0]
        projections, readout = layer.fused_step_projections(), self.readout_layer(self.fc.weight.dtype)
        if projections is None or readout is None:
            return None
        return FusedStepParts(self.embedding_table.weight, (None, None, None, layer.post_attention_layernorm, None),
                              ((self.fc,), *projections, (readout,)), layer.self_attn.heads, layer.self_attn.kv_heads)

    def step(self, token_ids, hidden, positions, from_target, cache=None, batch=None, ttt_history=None,
             logits_at=None):
        emb = self.embed(token_ids).to(hidden.dtype)
        x = self.fc(torch.cat([emb, hidden], dim=-1))
        cos, sin = self.rope(positions, x.dtype)
        layer_cache = (cache.k[0], cache.v[0]) if cache is not None else None
        out = self.layers[0](x, x, cos, sin, layer_cache, batch, ttt_history)
        return out, self.readout(self._at(out, logits_at))
