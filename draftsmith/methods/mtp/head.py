"""MTP head (DeepSeek-V3 style multi-token prediction), for converted target layers and for heads draftsmith
trains: h' = input_proj(cat(token_norm(embed(x_{t+1})), hidden_norm(h_t))) in the layout's order, one
decoder block of the target's kind, and logits = lm_head(final_norm(h')).

As vLLM computes them (vllm/model_executor/models/{deepseek_mtp,mimo_mtp}.py): h_0 is the target's final
normed hidden state (what its forward returns); the embedding is zeroed at position 0; the state fed back
to the next step is the block's output for DeepSeek-style layers and its `final_norm` output for MiMo's
(whose layer returns the normed state), which is the layout draftsmith trains and exports. Drafting uses
layer 0 for every step, as vLLM's v1 proposer does; further layers of a converted checkpoint are loaded
and kept (they export again) but do not draft. The embedding and LM head are the target's (DeepSeek stores
copies; blocks of that kind are MLA/MoE, which the runtime does not run, so those never load here).
"""

from __future__ import annotations

import torch
from torch import nn

from draftsmith.models.config import TargetConfig
from draftsmith.models.draft_layer import DraftDecoderLayer
from draftsmith.models.draft_step_cpu import FusedStepParts
from draftsmith.models.head_configs import MTPConfig
from draftsmith.models.heads import RecurrentHead
from draftsmith.models.linear import Linear
from draftsmith.models.llama import RMSNorm


class MTPLayer(nn.Module):
    """One MTP layer under the native names (`token_norm`, `hidden_norm`, `input_proj`, `block.*` in HF
    decoder-layer names, `final_norm`)."""

    def __init__(self, shape: TargetConfig, with_input_proj: bool = True):
        super().__init__()
        h, eps = shape.hidden_size, shape.rms_norm_eps
        if with_input_proj:
            self.token_norm = RMSNorm(h, eps)
            self.hidden_norm = RMSNorm(h, eps)
            self.input_proj = Linear(2 * h, h, bias=False)
            self.final_norm = RMSNorm(h, eps)
        self.block = DraftDecoderLayer(h, h, shape.intermediate_size, shape.num_attention_heads,
                                       shape.num_key_value_heads, shape.head_dim, eps,
                                       attention_bias=shape.qkv_bias, qk_norm=shape.qk_norm,
                                       window=shape.sliding_window)
        self.block.input_layernorm = RMSNorm(h, eps)  # a full decoder layer: its input is normed


class MTPHead(RecurrentHead):
    head_type = "mtp"
    reads_out_through_target = True

    def __init__(self, config: MTPConfig):
        super().__init__(config, config.block_config())
        # Qwen3-Next: one input projection and norm pair (layer 0's) serves every block
        self.layers = nn.ModuleList(MTPLayer(self.layer_shape, with_input_proj=k == 0 or not config.shared_input_proj)
                                    for k in range(config.num_layers))

    @classmethod
    def for_target(cls, target_config: TargetConfig, source_config: dict, target_model: str = "") -> MTPHead:
        """One MTP layer shaped like a layer of the target, in MiMo's layout (the one vLLM loads for a block of
        the Llama family): `source_config` is the target's config.json."""
        config = MTPConfig(layout="mimo", num_layers=1, hidden_size=target_config.hidden_size,
                           vocab_size=target_config.vocab_size, target_num_layers=target_config.num_hidden_layers,
                           concat_order="hidden_first", target_model=target_model,
                           source_config={**source_config, "num_nextn_predict_layers": 1})
        return cls(config)

    @torch.no_grad()
    def init_from_target(self) -> None:
        """Starts the block from the target's last decoder layer and the final norm from the target's."""
        last = self.target.model.layers[-1].state_dict()
        for layer in self.layers:
            layer.block.load_state_dict({k: v.float() for k, v in last.items()})
            layer.final_norm.weight.copy_(self.target.model.norm.weight.float())

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return (self.target.config.num_hidden_layers,)  # the final normed hidden state

    @property
    def sliding_window(self) -> int | None:
        return self.layer_shape.sliding_window

    def fused_step_parts(self) -> FusedStepParts | None:
        """What `models.draft_step_cpu` runs `step` from as one op; None with q/k norms, or a readout that
        casts."""
        layer = self.layers[0]
        projections, readout = layer.block.fused_step_projections(), self.readout_layer(layer.input_proj.weight.dtype)
        if projections is None or readout is None:
            return None
        block = layer.block
        return FusedStepParts(self.target.model.embed_tokens.weight,
                              (layer.token_norm, layer.hidden_norm, block.input_layernorm,
                               block.post_attention_layernorm, layer.final_norm),
                              ((layer.input_proj,), *projections, (readout,)), block.self_attn.heads,
                              block.self_attn.kv_heads, state_first=self.config.concat_order != "embedding_first",
                              feed_back_normed=self.config.feeds_back_normed, zero_first_embedding=True)

    def step(self, token_ids, hidden, positions, from_target, cache=None, batch=None, ttt_history=None,
             logits_at=None):
        layer = self.layers[0]
        emb = self.target.model.embed_tokens(token_ids).to(hidden.dtype).masked_fill(positions[..., None] == 0, 0)
        emb = layer.token_norm(emb)
        parts = (emb, layer.hidden_norm(hidden))
        x = layer.input_proj(torch.cat(parts if self.config.concat_order == "embedding_first" else parts[::-1], -1))
        cos, sin = self.rope(positions, x.dtype)
        layer_cache = (cache.k[0], cache.v[0]) if cache is not None else None
        out = layer.block(layer.block.input_layernorm(x), x, cos, sin, layer_cache, batch, ttt_history)
        if self.config.feeds_back_normed:
            out = layer.final_norm(out)
            return out, self.readout(self._at(out, logits_at))
        return out, self.readout(layer.final_norm(self._at(out, logits_at)))
