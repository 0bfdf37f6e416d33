"""The one decoder layer EAGLE-style heads are built from, with the two attention patterns they need.

Serving: plain causal attention over the head's own per-slot KV cache (`ForwardBatch`, as the target).
Training-time test (EAGLE-3 TTT): step 0 is causal over the sequence; at step s a query at position j also
sees, at its own position only, the keys of steps 1..s (the "diagonal" extension). That is exactly what a
query sees at serving time when it sits s draft steps past the verified prefix, so one module serves both.
Steps after the first may run at some of step 0's positions only (`TTTHistory.rows`): each position's later
steps see nothing of another's, so a position's logits are the same whichever others run beside it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from draftsmith.models.attention import batch_attention
from draftsmith.models.kv_cache import ForwardBatch
from draftsmith.models.linear import Linear, fused
from draftsmith.models.llama import MLP, RMSNorm
from draftsmith.models.rope import apply_rope_qk


class TTTHistory(list):
    """One layer's training-time-test keys and values (step 0's over the sequence, then one entry per later
    step), or a head's list of them. `rows` [B, A]: the step-0 positions that the later steps' queries sit at,
    ascending per row; None: every position. `window_at_query`: a later step s's window ends at its own
    position t + s, where P-EAGLE serves its slots in one forward (each query's window at its position), so
    it holds W - s step-0 keys; otherwise at t, where a sequential head's draft steps read (`_key_starts`)."""

    def __init__(self, rows: torch.Tensor | None = None, window_at_query: bool = False):
        super().__init__()
        self.rows = rows
        self.window_at_query = window_at_query


class DraftAttention(nn.Module):
    """`qk_norm`: Qwen3's per-head RMSNorm of queries and keys before RoPE. `window`: in training, each query
    attends to the newest `window` positions (its own included); serving gets the same from its ForwardBatch."""

    def __init__(self, in_dim: int, hidden: int, heads: int, kv_heads: int, head_dim: int, bias: bool = False,
                 qk_norm: bool = False, eps: float = 1e-6, window: int | None = None):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.window = heads, kv_heads, head_dim, window
        self.q_proj = Linear(in_dim, heads * head_dim, bias=bias)
        self.k_proj = Linear(in_dim, kv_heads * head_dim, bias=bias)
        self.v_proj = Linear(in_dim, kv_heads * head_dim, bias=bias)
        self.o_proj = Linear(heads * head_dim, hidden, bias=False)
        if qk_norm:
            self.q_norm, self.k_norm = RMSNorm(head_dim, eps), RMSNorm(head_dim, eps)

    def fused_linears(self) -> tuple[tuple[Linear, ...], ...]:
        return ((self.q_proj, self.k_proj, self.v_proj),)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: tuple[torch.Tensor, torch.Tensor] | None = None, batch: ForwardBatch | None = None,
                ttt_history: list[tuple[torch.Tensor, torch.Tensor]] | None = None) -> torch.Tensor:
        rows, width, _ = x.shape
        q, k, v = fused(self.fused_linears()[0], x)
        q = q.view(rows, width, self.heads, self.head_dim)
        k = k.view(rows, width, self.kv_heads, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope_qk(q, k, cos, sin)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = v.view(rows, width, self.kv_heads, self.head_dim).transpose(1, 2)
        if cache is not None:
            batch.write(cache[0], k)
            batch.write(cache[1], v)
            out = batch_attention(q, cache[0], cache[1], batch)
        elif not ttt_history:
            if self.window is None or self.window >= width:
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            else:
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=_causal(width, self.window, q.device),
                                                     enable_gqa=True)
            if ttt_history is not None:
                ttt_history.append((k, v))
        else:
            ttt_history.append((k, v))
            window = self.window
            if window is not None and getattr(ttt_history, "window_at_query", False):
                window -= len(ttt_history) - 1  # the step's own drafts fill the rest of its window
            out = _ttt_attention(q, ttt_history, window, getattr(ttt_history, "rows", None))
        return self.o_proj(out.transpose(1, 2).reshape(rows, width, self.heads * self.head_dim))


def _causal(width: int, window: int | None, device) -> torch.Tensor:
    """[width, width] bool: query i may see key j <= i, and with a window only j > i - window."""
    return _causal_rows(torch.arange(width, device=device)[None], width, window)[0, 0]


def _ttt_attention(q: torch.Tensor, history: list[tuple[torch.Tensor, torch.Tensor]],
                   window: int | None = None, rows: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, H, A, D]; history[0] = step-0 (k, v) [B, KV, T, D], history[1:] = later steps [B, KV, A, D], this
    one last. The queries sit at step-0 positions `rows` [B, A] (None: A = T, all of them). The later steps'
    keys sit at the query's own position, inside any window."""
    groups = q.shape[1] // history[0][0].shape[1]
    expand = (lambda t: t.repeat_interleave(groups, dim=1)) if groups > 1 else (lambda t: t)
    scale = 1.0 / math.sqrt(q.shape[-1])
    k0, v0 = expand(history[0][0]), expand(history[0][1])
    width = k0.shape[2]
    visible = _causal(width, window, q.device) if rows is None else _causal_rows(rows, width, window)
    scores = (q @ k0.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~visible, float("-inf"))
    diagonal = torch.stack([(q * expand(k)).sum(-1) * scale for k, _ in history[1:]], dim=-1)  # [B,H,A,S]
    weights = torch.cat([scores, diagonal], dim=-1).float().softmax(-1).to(q.dtype)
    out = weights[..., :width] @ v0
    for i, (_, v) in enumerate(history[1:]):
        out = out + weights[..., width + i, None] * expand(v)
    return out


def _causal_rows(rows: torch.Tensor, width: int, window: int | None) -> torch.Tensor:
    """[B, 1, A, width] bool: a query at position rows[b, a] may see key j <= it (and with a window only
    j > it - window)."""
    distance = rows[:, None, :, None] - torch.arange(width, device=rows.device)
    return (distance >= 0) & (distance < window) if window is not None else distance >= 0


class DraftDecoderLayer(nn.Module):
    """Llama block whose attention input may be wider than the residual (EAGLE-3 feeds [emb; hidden])."""

    def __init__(self, in_dim: int, hidden: int, intermediate: int, heads: int, kv_heads: int, head_dim: int,
                 eps: float, input_norms: bool = False, attention_bias: bool = False, qk_norm: bool = False,
                 window: int | None = None):
        super().__init__()
        if input_norms:  # EAGLE-3 normalizes the embedding and the hidden input separately
            self.input_layernorm = RMSNorm(hidden, eps)
            self.hidden_norm = RMSNorm(hidden, eps)
        self.self_attn = DraftAttention(in_dim, hidden, heads, kv_heads, head_dim, bias=attention_bias,
                                        qk_norm=qk_norm, eps=eps, window=window)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.mlp = _mlp(hidden, intermediate)

    def fused_step_projections(self) -> tuple[tuple[Linear, ...], ...] | None:
        """(q, k, v), (o,), (gate, up), (down,) as its forward groups them, for a head's one-token step run as
        one op (`models.draft_step_cpu`); None where its attention has q/k norms, which the op does not run. A
        window needs nothing of the op: over a cache, a step reads keys from each row's first key on, which the
        proposer sets from the window (`EagleFamilyProposer._key_starts`)."""
        attention, mlp = self.self_attn, self.mlp
        if hasattr(attention, "q_norm"):
            return None
        return (*attention.fused_linears(), (attention.o_proj,), *mlp.fused_linears(), (mlp.down_proj,))

    def forward(self, attn_input, residual, cos, sin, cache=None, batch=None, ttt_history=None):
        x, normed = self.post_attention_layernorm.after_add(
            residual, self.self_attn(attn_input, cos, sin, cache, batch, ttt_history))
        return x + self.mlp(normed)


def _mlp(hidden: int, intermediate: int) -> MLP:
    class _Shape:  # MLP reads these three fields only
        hidden_size, intermediate_size, mlp_bias = hidden, intermediate, False

    return MLP(_Shape)
