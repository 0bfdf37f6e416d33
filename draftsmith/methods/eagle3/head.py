"""EAGLE-3 head: fc fuses three target layers, one decoder layer attends over [norm(embedding); norm(hidden)],
its own final norm and LM head over a reduced draft vocabulary mapped back with `d2t`.

A head of `num_hidden_layers` > 1 (vLLM's llama_eagle3 builds them; P-EAGLE's published heads have four)
stacks plain pre-norm Llama layers after that first one, named `layers.1.*`, `layers.2.*`, ... beside
`midlayer.*` (vLLM's names for them); each has its own KV cache layer and training-time-test history.

`d2t[i]` is an offset: draft id i is target id `i + d2t[i]`; `t2d[v]` marks target ids in the draft vocab
(the yuhuili/SpecForge convention, so these buffers convert as they are).

The variants current trainers write (`DraftHeadConfig.VARIANTS`, as speculators 0.9 computes them): a norm
over the fused features before fc (`input_norm`, one over all; `fc_norm.i`, one per layer), the normed hidden
input as the layer's residual, the final norm's output fed back (EAGLE 3.1), a Qwen3-style layer (q/k norms)
and a sliding attention window.
"""

from __future__ import annotations

import torch
from torch import nn

from draftsmith.methods.eagle3.vocab import check_vocab_maps
from draftsmith.models.draft_layer import DraftDecoderLayer, TTTHistory
from draftsmith.models.draft_step_cpu import FusedStepParts
from draftsmith.models.heads import DraftHead, DraftHeadConfig
from draftsmith.models.linear import Linear
from draftsmith.models.llama import RMSNorm


class Eagle3Head(DraftHead):
    head_type = "eagle3"
    variants = DraftHeadConfig.VARIANTS

    def __init__(self, config: DraftHeadConfig):
        super().__init__(config)
        h, n_aux, eps = config.hidden_size, len(config.aux_layer_ids), config.rms_norm_eps
        if config.norm_before_fc:
            self.input_norm = RMSNorm(n_aux * config.target_hidden_size, eps)
        if config.fc_norm:
            self.fc_norm = nn.ModuleList(RMSNorm(config.target_hidden_size, eps) for _ in range(n_aux))
        self.fc = Linear(n_aux * config.target_hidden_size, h, bias=config.fc_bias)
        self.midlayer = DraftDecoderLayer(2 * h, h, config.intermediate_size, config.num_attention_heads,
                                          config.num_key_value_heads, config.head_dim, eps, input_norms=True,
                                          attention_bias=config.attention_bias, qk_norm=config.qk_norm,
                                          window=config.sliding_window)
        self.layers = nn.ModuleDict({str(i): self._later_layer(config) for i in range(1, config.num_hidden_layers)})
        if config.own_embedding:
            self.embed_tokens = nn.Embedding(config.vocab_size, h)
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.lm_head = Linear(h, config.draft_vocab_size, bias=False)
        if config.parallel_drafting:  # P-EAGLE: the fused feature every draft slot after the first reads
            self.mask_hidden = nn.Parameter(torch.zeros(1, 1, n_aux * config.target_hidden_size))
        # until `set_vocab`, the identity maps: draft id i is target id i
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.arange(config.vocab_size) < config.draft_vocab_size)

    @staticmethod
    def _later_layer(config: DraftHeadConfig) -> DraftDecoderLayer:
        """A layer after the first: a Llama block over the residual stream, its input normed."""
        h, eps = config.hidden_size, config.rms_norm_eps
        layer = DraftDecoderLayer(h, h, config.intermediate_size, config.num_attention_heads,
                                  config.num_key_value_heads, config.head_dim, eps,
                                  attention_bias=config.attention_bias, qk_norm=config.qk_norm,
                                  window=config.sliding_window)
        layer.input_layernorm = RMSNorm(h, eps)
        return layer

    @property
    def cache_layers(self) -> int:
        return self.config.num_hidden_layers

    @torch.no_grad()
    def start_layers_as_identity(self, names: list[str]) -> None:
        """Zeroes the named later layers' output projections, so that each passes its input through until
        training moves them (how a head grows layers without losing what it has learned)."""
        for name in names:
            layer = self.layers[name]
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()

    def set_vocab(self, draft_to_target: torch.Tensor) -> None:
        """draft_to_target [draft_vocab] ascending target ids -> the d2t/t2d buffers."""
        ids = draft_to_target.to(self.d2t.device, torch.long)
        self.d2t.copy_(ids - torch.arange(len(ids), device=ids.device))
        self.t2d.zero_()
        self.t2d[ids] = True

    @torch.no_grad()
    def init_draft_vocab(self, draft_to_target: torch.Tensor) -> None:
        """Sets the vocab maps and starts the LM head and final norm from the target's (faster convergence)."""
        self.set_vocab(draft_to_target)
        self.lm_head.weight.copy_(self.target.lm_head.weight[draft_to_target].float())
        self.norm.weight.copy_(self.target.model.norm.weight.float())

    def check_weights(self) -> None:
        """The loaded vocab maps are EAGLE-3's (a one-line error, not an index past the vocabulary at serving)."""
        check_vocab_maps(self.d2t, self.t2d, self.config.vocab_size)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def draft_offsets(self) -> torch.Tensor:
        return self.d2t

    def step(self, token_ids, hidden, positions, from_target, cache=None, batch=None, ttt_history=None,
             logits_at=None):
        if from_target:
            hidden = self.state_from_target(hidden)
        emb = self.embed(token_ids).to(hidden.dtype)
        layer, c = self.midlayer, self.config
        normed = layer.hidden_norm(hidden)
        attn_input = torch.cat([layer.input_layernorm(emb), normed], dim=-1)
        cos, sin = self.rope(positions, hidden.dtype)
        histories = self._layer_histories(ttt_history)
        out = layer(attn_input, normed if c.norm_before_residual else hidden, cos, sin, self._cache_at(cache, 0),
                    batch, histories[0])
        for i, later in enumerate(self.layers.values(), start=1):
            out = later(later.input_layernorm(out), out, cos, sin, self._cache_at(cache, i), batch, histories[i])
        if c.norm_output:  # the normed output is both read out and fed back
            out = self.norm(out)
            return out, self.lm_head(self._at(out, logits_at))
        return out, self.lm_head(self.norm(self._at(out, logits_at)))

    def fused_step_parts(self) -> FusedStepParts | None:
        """What `models.draft_step_cpu` runs `step` from at one query a row (drafts 2..k) as one op; None for
        the variants it does not run (q/k norms, later layers)."""
        c, layer = self.config, self.midlayer
        projections = layer.fused_step_projections()
        if projections is None or c.num_hidden_layers > 1:
            return None
        return FusedStepParts(self.embedding_table.weight, (layer.input_layernorm, layer.hidden_norm, None,
                                             layer.post_attention_layernorm, self.norm),
                              (None, *projections, (self.lm_head,)), layer.self_attn.heads, layer.self_attn.kv_heads,
                              normed_residual=c.norm_before_residual, feed_back_normed=c.norm_output)

    @staticmethod
    def _cache_at(cache, layer: int):
        return (cache.k[layer], cache.v[layer]) if cache is not None else None

    def _layer_histories(self, ttt_history: list | None) -> list:
        """One training-time-test history per layer, kept inside the caller's list (filled on its first step), each
        with the caller's `rows`."""
        if ttt_history is None:
            return [None] * self.config.num_hidden_layers
        if not ttt_history:
            rows, at_query = getattr(ttt_history, "rows", None), getattr(ttt_history, "window_at_query", False)
            ttt_history.extend(TTTHistory(rows, at_query) for _ in range(self.config.num_hidden_layers))
        return ttt_history

    def state_from_target(self, features: torch.Tensor) -> torch.Tensor:
        return self.fc(self._fc_input(features))

    def parallel_inputs(self, rows: int, slots: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """P-EAGLE's draft slots after the first: (token ids [rows, slots], all `ptd_token_id`, and their fused
        features [rows, slots, F], all `mask_hidden`), read with from_target as a target feature is."""
        tokens = torch.full((rows, slots), self.config.ptd_token_id, dtype=torch.long, device=device)
        return tokens, self.mask_hidden.expand(rows, slots, -1)

    def _fc_input(self, features: torch.Tensor) -> torch.Tensor:
        if self.config.norm_before_fc:
            return self.input_norm(features)
        if self.config.fc_norm:
            chunks = features.chunk(len(self.fc_norm), dim=-1)
            return torch.cat([norm(chunk) for norm, chunk in zip(self.fc_norm, chunks)], dim=-1)
        return features
