"""What `slot_attention` (the Triton kernel in slot_attention_triton.py) computes, in plain PyTorch: attention
of a few new queries per row (decode, a k + 1 verify, a draft step, a DFlash block) over that row's slot of
the KV cache, read in place.

Row b reads slot `slots[b]`; its query i sits at position `positions[b, i]`; it sees key position p when
- key_starts[b] <= p < kv_lens[b] (the keys written for the row; default key_starts 0),
- causally, p <= positions[b, i]; or with a `tree_mask` [B, Q, Q], every key before the row's block
  (p < block_starts[b]) and, inside it, the block keys j with tree_mask[b, i, j] (tree verification; an
  all-True mask is DFlash's non-causal block),
- and with a sliding `window`, p > positions[b, i] - window.
Query head h reads KV head h // (heads / kv_heads) (GQA, as HF's repeat_kv). A query that sees no key gets
zeros.
"""

from __future__ import annotations

import torch


def visible_keys(positions: torch.Tensor, kv_lens: torch.Tensor, num_keys: int, key_starts: torch.Tensor | None = None,
                 window: int | None = None, tree_mask: torch.Tensor | None = None,
                 block_starts: torch.Tensor | None = None) -> torch.Tensor:
    """[B, Q, num_keys] bool: which key positions 0..num_keys-1 each query sees (the rules above)."""
    keys = torch.arange(num_keys, device=positions.device)[None, None, :]
    query = positions[:, :, None]
    seen = keys < kv_lens[:, None, None]
    if key_starts is not None:
        seen = seen & (keys >= key_starts[:, None, None])
    if tree_mask is None:
        seen = seen & (keys <= query)
    else:
        offset = keys - block_starts[:, None, None]  # the key's place in the block
        in_block = offset >= 0
        width = tree_mask.shape[-1]
        tree = tree_mask.gather(2, offset.clamp(0, width - 1).expand(tree_mask.shape[0], tree_mask.shape[1], -1))
        seen = seen & (~in_block | (tree & (offset < width)))
    if window is not None:
        seen = seen & (keys > query - window)
    return seen


def slot_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                             positions: torch.Tensor, kv_lens: torch.Tensor, key_starts: torch.Tensor | None = None,
                             window: int | None = None, tree_mask: torch.Tensor | None = None,
                             block_starts: torch.Tensor | None = None, scale: float | None = None) -> torch.Tensor:
    """q [B, H, Q, D]; k_cache, v_cache [S, KVH, L, D]; slots, kv_lens [B]; positions [B, Q] -> [B, H, Q, D]
    in q's dtype, computed in fp32."""
    rows, heads, _, dim = q.shape
    kv_heads = k_cache.shape[1]
    num_keys = int(kv_lens.max())
    keys = k_cache[slots, :, :num_keys].float().repeat_interleave(heads // kv_heads, dim=1)  # [B, H, K, D]
    values = v_cache[slots, :, :num_keys].float().repeat_interleave(heads // kv_heads, dim=1)
    seen = visible_keys(positions, kv_lens, num_keys, key_starts, window, tree_mask, block_starts)[:, None]
    scores = q.float() @ keys.transpose(-1, -2) * (scale if scale is not None else dim**-0.5)
    weights = torch.softmax(scores.masked_fill(~seen, float("-inf")), dim=-1).nan_to_num(0.0)
    return (weights @ values).to(q.dtype)
