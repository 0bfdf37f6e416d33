"""DFlash (arXiv 2602.06036): a block drafter. The target's hidden states at a few layers are fused (`fc`, then
`hidden_norm`) into one context vector per position, which every draft layer projects with its own k/v
projections into "context" keys and values. A block `[bonus token, mask, ..., mask]` (`block_size` tokens, the
target's own embeddings) then runs through the draft layers in ONE forward, each block token attending to the
whole context and to the whole block (not causally), and the target's LM head turns block positions into
drafts. Two block layouts exist, and a head is trained for one (`sample_from_anchor`, speculators' key):
- 1+N, DFlash's (false): block position i predicts the token at its own position, so positions
  1..block_size-1 give that many drafts and the bonus token's own output is not read;
- anchor-first, DSpark's (true): block position i predicts the token after it, as an LM does, so all
  block_size positions give drafts.
Read under the other layout, every draft is one position off and acceptance collapses (vLLM #56792).

Layers are Qwen3 decoder layers (q/k norms; the context keys are k-normed and rotated at their own
positions too), as in z-lab's reference and vLLM's `qwen3_dflash.py`; parameter names are z-lab's (`fc`,
`hidden_norm`, `layers.N.*`, `norm`). The embedding and LM head are the target's, never trained or stored.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from draftsmith.errors import DraftsmithError
from draftsmith.models.config import RopeConfig, TargetConfig
from draftsmith.models.head_configs import HeadConfig
from draftsmith.models.heads import AttachedHead
from draftsmith.models.kv_cache import KVCache
from draftsmith.models.linear import Linear, fused
from draftsmith.models.llama import DecoderLayer, RMSNorm
from draftsmith.models.rope import apply_rope_heads, apply_rope_qk, rope_tables


@dataclass
class DFlashConfig(HeadConfig):
    head_type: ClassVar[str] = "dflash"
    hidden_size: int  # the target's: the block reads the target's embeddings and its LM head reads the block
    intermediate_size: int
    num_hidden_layers: int  # draft layers
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    target_hidden_size: int
    target_num_layers: int
    aux_layer_ids: tuple[int, ...]  # HF hidden_states indices (speculators' and vLLM's; z-lab's ids are one less)
    block_size: int  # bonus token + block_size - 1 masks
    mask_token_id: int
    sample_from_anchor: bool = False  # the block layout: anchor-first (true) or 1+N (false), as above
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = field(default_factory=RopeConfig)
    max_position_embeddings: int = 2048
    attention_bias: bool = False
    target_model: str = ""
    # Block position j (at p) attends over the newest `sliding_window` positions up to p and the rest of its
    # block (vLLM's non-causal window: `dflash_config.use_swa`), in training and serving alike; None: the whole
    # context. A head trained on sequences of L tokens saw at most L - block_size context positions.
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        if self.block_size < 2:
            raise DraftsmithError(f"DFlash block_size {self.block_size}: at least 2 (the bonus token and one mask)")
        if self.sliding_window is not None and self.sliding_window <= self.block_size:
            raise DraftsmithError(f"DFlash sliding_window {self.sliding_window}: more than block_size "
                                  f"{self.block_size}, or the block sees no context")

    @classmethod
    def _parse_fields(cls, data: dict[str, Any]) -> dict[str, Any]:
        parsed = {**data, "rope": RopeConfig(**data.get("rope", {}))}
        if "aux_layer_ids" in data:  # missing, the dataclass names it (a one-line error in from_json)
            parsed["aux_layer_ids"] = tuple(data["aux_layer_ids"])
        return parsed

    def layer_config(self) -> TargetConfig:
        """The draft layers' architecture: Qwen3 decoder layers (q/k norms)."""
        return TargetConfig(model_type="qwen3", vocab_size=self.vocab_size, hidden_size=self.hidden_size,
                            intermediate_size=self.intermediate_size, num_hidden_layers=self.num_hidden_layers,
                            num_attention_heads=self.num_attention_heads, num_key_value_heads=self.num_key_value_heads,
                            head_dim=self.head_dim, rms_norm_eps=self.rms_norm_eps, rope=self.rope,
                            max_position_embeddings=self.max_position_embeddings, qkv_bias=self.attention_bias,
                            qk_norm=True)

    def check_target(self, target: TargetConfig) -> None:
        pairs = [("hidden size", self.hidden_size, target.hidden_size), ("vocab size", self.vocab_size, target.vocab_size),
                 ("feature width", self.target_hidden_size, target.hidden_size),
                 ("layer count", self.target_num_layers, target.num_hidden_layers)]
        for what, head_value, target_value in pairs:
            if head_value != target_value:
                raise DraftsmithError(f"DFlash head expects target {what} {head_value}, but the target has {target_value}")
        bad = [i for i in self.aux_layer_ids if not 0 <= i <= target.num_hidden_layers]
        if bad:
            raise DraftsmithError(f"aux_layer_ids {bad} out of range for a {target.num_hidden_layers}-layer target")
        if not 0 <= self.mask_token_id < target.vocab_size:
            raise DraftsmithError(f"DFlash mask_token_id {self.mask_token_id} is outside the target's vocabulary of "
                                  f"{target.vocab_size}")

    @property
    def first_draft_slot(self) -> int:
        """The block position whose output is the first draft: 0 anchor-first, 1 in the 1+N layout."""
        return 0 if self.sample_from_anchor else 1

    def max_drafts(self) -> int:
        return self.block_size - self.first_draft_slot

    def draft_slots(self, drafts: int) -> slice:
        """The block positions whose outputs are drafts 1..`drafts`."""
        return slice(self.first_draft_slot, self.first_draft_slot + drafts)


# (q [B, heads, T, D], k, v [B, kv_heads, T, D] of the block) -> attention output [B, heads, T, D]
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class DFlashHead(AttachedHead):
    head_type = "dflash"

    def __init__(self, config: DFlashConfig):
        super().__init__(config)
        layer_config = config.layer_config()
        self.fc = Linear(len(config.aux_layer_ids) * config.target_hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.layers = nn.ModuleList(DecoderLayer(layer_config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rope_cos: torch.Tensor | None = None
        self.rope_sin: torch.Tensor | None = None

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return self.config.aux_layer_ids

    def features(self, hidden_states: dict[int, torch.Tensor]) -> torch.Tensor:
        return torch.cat([hidden_states[i] for i in self.feature_layers], dim=-1)

    def init_rope(self, max_len: int, device: torch.device) -> None:
        """Sizes the cos/sin tables for positions below `max_len` (no bigger table is kept)."""
        if self.rope_cos is None or self.rope_cos.device != device or self.rope_cos.shape[0] < max_len:
            length = max(self.config.max_position_embeddings, max_len)
            self.rope_cos, self.rope_sin = rope_tables(self.config.rope, self.config.head_dim, length, device)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # positions past the tables are the caller's to prevent (init_rope): checking here would read them on
        # the host every call
        self.init_rope(0, positions.device)
        return self.rope_cos[positions].to(dtype), self.rope_sin[positions].to(dtype)

    def make_cache(self, num_slots: int, max_len: int) -> KVCache:
        w, c = self.fc.weight, self.config
        return KVCache(c.num_hidden_layers, num_slots, max_len, c.num_key_value_heads, c.head_dim, w.dtype, w.device)

    def fused_linears(self) -> tuple[tuple[Linear, ...], ...]:
        """Every draft layer's context k and v projections read the same fused context: one oneDNN call for
        all of them (`fused`), not two per layer."""
        return (tuple(p for layer in self.layers for p in (layer.self_attn.k_proj, layer.self_attn.v_proj)),)

    def context_kv(self, features: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Target features [B, T, F] at `positions` [B, T] -> per draft layer the context keys (k-normed and
        rotated) and values, each [B, kv_heads, T, head_dim]."""
        context = self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))
        cos, sin = self.rope(positions, context.dtype)
        c, lead = self.config, context.shape[:-1]
        projected = fused(self.fused_linears()[0], context)  # k, v of layer 0, k, v of layer 1, ...
        out = []
        for layer, k, v in zip(self.layers, projected[0::2], projected[1::2]):
            # turned per head before the transpose: one C++ op on CPU (`apply_rope_heads`), not five aten ones
            k = apply_rope_heads(layer.self_attn.k_norm(k.view(*lead, c.num_key_value_heads, c.head_dim)), cos, sin)
            v = v.view(*lead, c.num_key_value_heads, c.head_dim)
            out.append((k.transpose(1, 2), v.transpose(1, 2)))
        return out

    def embed_block(self, first_tokens: torch.Tensor) -> torch.Tensor:
        """first_tokens [B, A] (each block's bonus token) -> [B, A * block_size, hidden]: the target's embeddings
        of [token, mask, ..., mask] per block."""
        rows, blocks = first_tokens.shape
        ids = torch.full((rows, blocks, self.config.block_size), self.config.mask_token_id,
                         dtype=torch.long, device=first_tokens.device)
        ids[:, :, 0] = first_tokens
        return self.target.model.embed_tokens(ids.view(rows, -1)).to(self.fc.weight.dtype)

    def block_forward(self, hidden: torch.Tensor, positions: torch.Tensor, attend: Attend,
                      outputs: slice | torch.Tensor = slice(None)) -> torch.Tensor:
        """Block embeddings [B, T, hidden] at `positions` -> final normed hidden states [B, T, hidden] of the
        block positions in `outputs`. `attend(i, q, k, v)` attends layer i's block queries over its context and
        the block's own keys and values. The last layer runs its queries, output projection and MLP for the
        `outputs` positions only: the others' keys and values are all that is read of them (serving reads
        positions 1..k, and below 9 rows a CPU GEMM runs unpadded)."""
        cos, sin = self.rope(positions, hidden.dtype)
        rows = hidden.shape[0]
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            q, k, v = attn._project(layer.input_layernorm(hidden))  # [B, T, heads, head_dim]
            q, k = apply_rope_qk(q, k, cos, sin)  # on CPU one or two C++ ops a layer, not ten aten ones
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            if i == last:
                q, hidden = q[:, :, outputs], hidden[:, outputs]
            out = attend(i, q, k, v)
            attended = attn.o_proj(out.transpose(1, 2).reshape(rows, hidden.shape[1], -1))
            hidden, normed = layer.post_attention_layernorm.after_add(hidden, attended)
            hidden = hidden + layer.mlp(normed)
        return self.norm(hidden)

    def readout(self, hidden: torch.Tensor) -> torch.Tensor:
        lm_head = self.target.lm_head
        return lm_head(hidden.to(lm_head.weight.dtype)).float()

    def training_forward(self, features: torch.Tensor, input_ids: torch.Tensor, anchors: torch.Tensor,
                         drafts: int | None = None) -> torch.Tensor:
        """Teacher-forced blocks: features [B, L, F] and input_ids [B, L] of whole sequences, anchors [B, A] (a
        block starts at each with the token there; its context is the positions before it) -> final hidden
        states [B, A * block_size, hidden] of the blocks' tokens, block by block; with `drafts`, of the block
        positions of drafts 1..drafts only (`draft_slots`), [B, A * drafts, hidden] (the last layer computes no
        others)."""
        rows, length = input_ids.shape
        size = self.config.block_size
        device = input_ids.device
        self.init_rope(length + size, device)
        context = self.context_kv(features, torch.arange(length, device=device).expand(rows, -1))
        offsets = torch.arange(size, device=device)
        positions = (anchors[:, :, None] + offsets).view(rows, -1)
        block_anchor = anchors[:, :, None].expand(-1, -1, size).reshape(rows, -1)  # [B, T]
        block_id = torch.arange(anchors.shape[1], device=device).repeat_interleave(size)
        keys = torch.arange(length, device=device)[None, None, :]
        sees_context = keys < block_anchor[:, :, None]
        if self.config.sliding_window is not None:  # the newest sliding_window positions up to the query's own
            sees_context &= keys > positions[:, :, None] - self.config.sliding_window
        sees_block = (block_id[:, None] == block_id[None, :]).expand(rows, -1, -1)
        mask = torch.cat([sees_context, sees_block], dim=-1)[:, None]  # [B, 1, T, L + T]
        outputs = slice(None)
        if drafts is not None:
            slots = self.config.draft_slots(drafts)
            outputs = (torch.arange(anchors.shape[1], device=device)[:, None] * size
                       + torch.arange(slots.start, slots.stop, device=device)).view(-1)
        last_mask = mask[:, :, outputs]  # the last layer's queries: the output positions'

        def attend(i, q, k, v):
            keys, values = context[i]
            return F.scaled_dot_product_attention(q, torch.cat([keys, k], 2), torch.cat([values, v], 2),
                                                  attn_mask=mask if q.shape[2] == mask.shape[2] else last_mask,
                                                  enable_gqa=True)

        return self.block_forward(self.embed_block(input_ids.gather(1, anchors)), positions, attend, outputs)
