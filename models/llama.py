"""Inference implementation of the Llama family (Llama 2/3, Mistral, Qwen2, Qwen3) over a per-slot KV cache.

Module names mirror HF's (`model.layers.N.self_attn.q_proj`, ...) so an HF state dict loads without a
renaming table. Hidden states use HF's `output_hidden_states` indexing: 0 is the embedding output, i in
1..L-1 the output of decoder layer i-1, and L the final-normed output. EAGLE heads name layers this way.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from draftsmith.models import step_ops_cpu
from draftsmith.models.attention import batch_attention, cached_attention, packed_slot_attention
from draftsmith.models.config import TargetConfig
from draftsmith.models.kv_cache import ForwardBatch, KVCache, UnpackedOnRead
from draftsmith.models.linear import Linear, fused
from draftsmith.models.prompt_attention import kernel_applies, prompt_attention
from draftsmith.models.rope import apply_rope_qk, rope_tables


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        # on CPU each small op of a decode step costs a few us whatever its size, and a norm runs six or more
        # there: one C++ op where it is loaded, the arithmetic of the forms below (tests/unit/test_step_ops_cpu.py)
        if weight.dtype == x.dtype and step_ops_cpu.runs_for(x):
            return step_ops_cpu.rms_norm(x, weight, self.eps)
        if x.dtype == torch.float32 and weight.dtype == torch.float32:
            # the same arithmetic as below (tests/unit/test_rope_norm_fast.py)
            return F.rms_norm(x, weight.shape, weight, self.eps)
        # fp32 statistics, cast back before the weight: HF's order, needed for bit-level parity in bf16.
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def after_add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + residual, this norm of it): a residual add and the norm that reads it, one C++ op where the step
        ops run (a pass over the rows and an op call fewer), else the add and `forward`."""
        if self.weight.dtype == x.dtype == residual.dtype and step_ops_cpu.runs_for(x):
            return step_ops_cpu.add_rms_norm(x, residual, self.weight, self.eps)
        total = x + residual
        return total, self(total)


class Attention(nn.Module):
    def __init__(self, cfg: TargetConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=cfg.qkv_bias)
        self.k_proj = Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=cfg.qkv_bias)
        self.v_proj = Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=cfg.qkv_bias)
        self.o_proj = Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: tuple[torch.Tensor, torch.Tensor] | None, batch: ForwardBatch | None,
                window_mask: torch.Tensor | None = None) -> torch.Tensor:
        if x.dim() == 2:  # packed: the batch's real tokens only (ForwardBatch.tokens)
            return self._packed(x, cos, sin, cache, batch)
        rows, width, _ = x.shape
        q, k, v = self._project(x)
        q, k = apply_rope_qk(q, k, cos, sin)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, heads, Q, head_dim]
        if cache is None:  # whole sequences at once (training, reference scoring)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=window_mask, is_causal=window_mask is None,
                                                 enable_gqa=True)
        else:
            k_cache, v_cache = cache
            batch.write(k_cache, k)
            batch.write(v_cache, v)
            out = batch_attention(q, k_cache, v_cache, batch)
        return self.o_proj(out.transpose(1, 2).reshape(rows, width, self.num_heads * self.head_dim))

    def fused_linears(self) -> tuple[tuple[Linear, ...], ...]:
        return ((self.q_proj, self.k_proj, self.v_proj),)

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [..., hidden] -> q [..., heads, head_dim], k and v [..., kv_heads, head_dim] (q/k normed if the
        model norms them)."""
        lead = x.shape[:-1]
        q, k, v = fused(self.fused_linears()[0], x)
        q = q.view(*lead, self.num_heads, self.head_dim)
        k = k.view(*lead, self.num_kv_heads, self.head_dim)
        v = v.view(*lead, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v

    def _packed(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: tuple[torch.Tensor, torch.Tensor], batch: ForwardBatch) -> torch.Tensor:
        """x [T, hidden], cos/sin [T, head_dim]: projections, rope and the cache write per real token; attention
        on the real queries where the C++ slot kernel runs the batch, else over the padded [B, Q] layout."""
        q, k, v = self._project(x)
        q, k = apply_rope_qk(q, k, cos, sin)  # [T, heads, head_dim]
        k_cache, v_cache = cache
        if batch.row_spans is not None:
            return self.o_proj(self._attend_rows(q, k, v, k_cache, v_cache, batch))
        batch.write_packed(k_cache, k)
        batch.write_packed(v_cache, v)
        out = packed_slot_attention(q, k_cache, v_cache, batch)
        if out is not None:
            return self.o_proj(out.reshape(out.shape[0], self.num_heads * self.head_dim))
        out = batch_attention(batch.unpack(q).transpose(1, 2), k_cache, v_cache, batch)  # q [B, heads, Q, head_dim]
        rows, _, width, _ = out.shape
        out = out.transpose(1, 2).reshape(rows * width, self.num_heads * self.head_dim)[batch.tokens]
        return self.o_proj(out)

    def _attend_rows(self, q, k, v, k_cache, v_cache, batch: ForwardBatch) -> torch.Tensor:
        """Packed q/k/v [T, heads, head_dim] of long rows (prompts), attended one row at a time: each over its
        own length, so no row pays for another's padding -> [T, heads * head_dim]. Rows from position 0
        without a window attend in one call of the prompt kernel where it runs (`prompt_attention`)."""
        spans, offset = [], 0
        for slot, start, n, causal in batch.row_spans:
            end, tokens = start + n, slice(offset, offset + n)
            k_cache[slot, :, start:end] = k[tokens].transpose(0, 1)
            v_cache[slot, :, start:end] = v[tokens].transpose(0, 1)
            spans.append((slot, start, n, offset, causal))
            offset += n
        width = self.num_heads * self.head_dim
        causal_spans = [span[:4] for span in spans if span[4]] if kernel_applies(q) else []
        attended = prompt_attention(q, k_cache, v_cache, causal_spans) if causal_spans else None
        if attended is not None and len(causal_spans) == len(spans):
            return attended.view(offset, width)
        outs = []
        for row, (slot, start, n, first, causal) in enumerate(spans):
            if causal and attended is not None:
                outs.append(attended[first : first + n].reshape(n, width))
                continue
            query, end = q[first : first + n].transpose(0, 1)[None], start + n  # [1, heads, n, head_dim]
            keys, values = k_cache[slot : slot + 1, :, batch.kv_start : end], v_cache[slot : slot + 1, :, batch.kv_start : end]
            if causal:  # from position 0, no window: SDPA's own causal kernel, no mask to read
                out = F.scaled_dot_product_attention(query, keys, values, is_causal=True, enable_gqa=True)
            else:
                mask = batch.mask[row : row + 1, :, :n, : end - batch.kv_start]
                out = cached_attention(query, keys, values, mask)
            outs.append(out[0].transpose(0, 1).reshape(n, width))
        return torch.cat(outs)


class MLP(nn.Module):
    def __init__(self, cfg: TargetConfig):
        super().__init__()
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def fused_linears(self) -> tuple[tuple[Linear, ...], ...]:
        return ((self.gate_proj, self.up_proj),)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = fused(self.fused_linears()[0], x)
        if up.dtype == gate.dtype and step_ops_cpu.runs_for(gate):
            return self.down_proj(step_ops_cpu.silu_mul(gate, up))
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TargetConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, cache, batch, window_mask=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, batch, window_mask)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_normed(self, x, normed, next_norm: RMSNorm, cos, sin, cache, batch, window_mask=None):
        """`forward` of the residual stream x given its input norm `normed` -> (the layer's output, `next_norm`
        of it): each residual add is taken with the norm that reads it (`RMSNorm.after_add`)."""
        attended = self.self_attn(normed, cos, sin, cache, batch, window_mask)
        x, normed = self.post_attention_layernorm.after_add(x, attended)
        return next_norm.after_add(x, self.mlp(normed))


class Backbone(nn.Module):
    def __init__(self, cfg: TargetConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


@dataclass
class ForwardOutput:
    logits: torch.Tensor | None  # [B, n, vocab] at the requested positions, fp32
    # HF hidden_states index -> [B, Q, hidden] (a packed forward's `UnpackedOnRead`: unpacked when read)
    hidden_states: Mapping[int, torch.Tensor]


class CausalLM(nn.Module):
    """A Llama-family decoder with an LM head; `forward` runs B rows of new tokens against the cache."""

    def __init__(self, cfg: TargetConfig):
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rope_cos: torch.Tensor | None = None
        self.rope_sin: torch.Tensor | None = None

    def init_rope(self, max_len: int) -> None:
        """Builds the fp32 cos/sin tables on the model's device for positions [0, max_len)."""
        device = self.model.embed_tokens.weight.device
        self.rope_cos, self.rope_sin = rope_tables(self.config.rope, self.config.head_dim, max_len, device)

    def make_cache(self, num_slots: int, max_len: int) -> KVCache:
        w = self.model.embed_tokens.weight
        return KVCache(self.config.num_hidden_layers, num_slots, max_len, self.config.num_key_value_heads,
                       self.config.head_dim, w.dtype, w.device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                cache: KVCache | None = None, batch: ForwardBatch | None = None,
                feature_layers: Sequence[int] = (), logits_index: torch.Tensor | None = None,
                compute_logits: bool = True, hidden_index: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None) -> ForwardOutput:
        """Runs input_ids [B, Q].

        Args:
            positions: [B, Q]; defaults to `batch.positions`, or 0..Q-1 without a cache.
            cache, batch: the KV cache and where these tokens go in it; both None = plain causal forward.
            feature_layers: HF `hidden_states` indices to return.
            logits_index: [B, n] query indices whose logits to compute; None = all Q.
            hidden_index: [B, m] query indices whose hidden states to return (real tokens only: in a packed
                batch a padding index would read another row's token); None = all Q.
            attention_mask: without a cache, [B, 1, Q, Q] bool (True = may attend) instead of causal order:
                training layouts whose tokens are not one causal sequence (PARD's mask-token segments).
        """
        if positions is None:
            positions = batch.positions if batch is not None else torch.arange(
                input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        # Tables are sized at load time (the engine passes max_model_len); no host sync on positions here.
        if self.rope_cos is None or self.rope_cos.device != input_ids.device or \
                (cache is None and input_ids.shape[1] > self.rope_cos.shape[0]):
            # plain attributes, not buffers: a model moved by accelerate (PARD training) leaves them behind
            self.init_rope(max(self.config.max_position_embeddings, input_ids.shape[1],
                               self.rope_cos.shape[0] if self.rope_cos is not None else 0))
        packed = batch is not None and batch.tokens is not None
        if packed:  # per-token work on the real tokens only: [T, ...] until the logits
            input_ids, positions = input_ids.reshape(-1)[batch.tokens], positions.reshape(-1)[batch.tokens]
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rope_cos[positions].to(x.dtype), self.rope_sin[positions].to(x.dtype)
        if attention_mask is not None and cache is not None:
            raise ValueError("attention_mask is for forwards without a cache; a cached batch carries its own mask")
        window_mask = attention_mask
        if cache is None and self.config.sliding_window is not None:
            # Without a cache the batch carries no mask; build the causal sliding-window one here.
            distance = positions[:, :, None] - positions[:, None, :]
            window = ((distance >= 0) & (distance < self.config.sliding_window))[:, None]
            window_mask = window if attention_mask is None else window & attention_mask
        wanted = set(feature_layers)
        last = self.config.num_hidden_layers
        hidden: dict[int, torch.Tensor] = {0: x} if 0 in wanted else {}
        layers = self.model.layers
        # each layer's input norm (and the final norm) is taken with the residual add before it
        normed = layers[0].input_layernorm(x) if last else self.model.norm(x)
        for i, layer in enumerate(layers):
            layer_cache = (cache.k[i], cache.v[i]) if cache is not None else None
            next_norm = layers[i + 1].input_layernorm if i + 1 < last else self.model.norm
            x, normed = layer.forward_normed(x, normed, next_norm, cos, sin, layer_cache, batch, window_mask)
            if i + 1 in wanted and i + 1 < last:
                hidden[i + 1] = x
        x = normed
        if last in wanted:
            hidden[last] = x
        logits = None
        if hidden_index is not None:
            # only what the caller reads: unpacking a prompt's every position of three layers into padded
            # rows had cost an EAGLE-3 engine 5-8% of its prefill steps (demo, 16 in flight), for a
            # proposer that keeps each row's last 64
            hidden = {i: _select(h, hidden_index, batch if packed else None) for i, h in hidden.items()}
        elif packed:
            hidden = UnpackedOnRead(hidden, batch)
        if compute_logits:
            if packed and logits_index is None:  # the LM head on real tokens only
                return ForwardOutput(logits=batch.unpack(self.lm_head(x).float()), hidden_states=hidden)
            if packed or logits_index is not None:
                x = _select(x, logits_index, batch if packed else None)
            logits = self.lm_head(x).float()
        return ForwardOutput(logits=logits, hidden_states=hidden)


def _select(x: torch.Tensor, index: torch.Tensor, packed: ForwardBatch | None) -> torch.Tensor:
    """x [B, Q, H], or with `packed` its real tokens [T, H] -> [B, n, H] at the rows' query indices [B, n]."""
    if packed is None:
        return x.gather(1, index[..., None].expand(-1, -1, x.shape[-1]))
    # rows' query indices -> indices among the packed tokens (sorted flat indices)
    width = packed.positions.shape[1]
    flat = torch.arange(len(index), device=x.device)[:, None] * width + index
    return x[torch.searchsorted(packed.tokens, flat)]
