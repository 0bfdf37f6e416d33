"""Attention of a few new queries per row over the KV cache (decode, verify, draft steps), fast on CPU.

On CPU, SDPA's kernels are built for long queries: for the engine's shapes, few queries per row against a few
hundred cached keys under a mask, they spend most of their time outside the arithmetic. On the dev VM (8
query heads over 2 KV heads, head_dim 64, 300 keys), 8 rows x 5 queries took 388 us per layer and 32 rows x
2 queries 958 us; two batched matmuls with the query heads of each KV group stacked as rows of one matrix
(so the keys are read once per group and never expanded), a masked softmax between them, take 250 and 455
us. Small batches (one row decoding) and prompts (many queries) keep SDPA, and so does CUDA, where its fused
kernels are the fast path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

GROUPED_UP_TO = 16  # queries per row: longer rows (prompt chunks) use SDPA's flash kernel
# queries in the batch: below this SDPA is faster still (one row, one query: 17 us against 48 in fp32; one row
# of 6 bf16 draft queries: 36 against 107), above it the grouped form (8 rows of one bf16 query: 318 against
# SDPA's 1340)
GROUPED_FROM = 8


def cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """q [B, heads, Q, D]; k, v [B, kv_heads, K, D] (strided views of the cache are fine); mask [B, 1, Q, K]
    bool, True = may attend -> [B, heads, Q, D]."""
    rows, heads, queries, dim = q.shape
    kv_heads = k.shape[1]
    if q.device.type != "cpu" or queries > GROUPED_UP_TO or rows * queries < GROUPED_FROM or heads % kv_heads:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    return grouped_attention(q, k, v, mask)


def grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The matmul form of `cached_attention` (any device): query head h belongs to KV head h // group, as in
    SDPA's enable_gqa and HF's repeat_kv."""
    rows, heads, queries, dim = q.shape
    kv_heads, keys = k.shape[1], k.shape[2]
    group = heads // kv_heads
    dtype = v.dtype
    if q.device.type == "cpu" and dtype != torch.float32:
        # CPU bf16 matmuls go to oneDNN, which compiles a kernel for each new shape, and the key count moves
        # every step: a bf16 draft head's attention page-faulted on fresh kernel code at almost every call
        # (0.5-1 ms a draft step at 8 rows). In fp32 the same small products run on MKL, compiled once.
        q, k, v = q.float(), k.float(), v.float()
    # rounded to the inputs' dtype where a matmul in it would round: the same drafts as in that dtype
    scores = torch.matmul(q.reshape(rows, kv_heads, group * queries, dim), k.transpose(-1, -2)).to(dtype) * dim**-0.5
    # a large negative, not -inf: a query with no key to attend (padding) gets a finite average, not NaN
    scores = scores.view(rows, kv_heads, group, queries, keys).masked_fill(
        ~mask[:, :, None], torch.finfo(scores.dtype).min)
    weights = torch.softmax(scores.float(), dim=-1).to(dtype).view(rows, kv_heads, group * queries, keys)
    return torch.matmul(weights.to(v.dtype), v).to(dtype).view(rows, heads, queries, dim)
