# ruff: noqa: N803, N806
"""`slot_attention`: attention of 1..16 new queries per row over the row's slot of the KV cache, as one Triton
kernel (math and mask rules in slot_attention_reference.py).

One program per (row, KV head, key split). It stacks the query heads of its KV group and the row's queries
as the rows of one tile (G x Q rows: 4 x 16 = 64 for Llama-3-8B's 32/8 heads verifying 15 drafts), so each
key tile is read from the cache once per group, in place (no gather of the slot, no repeat of the KV heads),
and runs an online softmax over key tiles; the mask (causal, or a block tree mask, a sliding window and the
row's own key range) is computed from positions, never read from memory. Long contexts are cut into
`num_splits` key ranges run side by side (split-K, flash-decoding), whose partial sums are merged after.

Written for this project from the FlashAttention-2 / flash-decoding algorithm (Dao 2023; Dao et al. 2023).
"""

from __future__ import annotations

import os

import torch

from draftsmith.models.kernel_backend import check_kernel_devices

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the engine keeps its PyTorch attention
    triton = None

# Triton's interpreter (3.9) multiplies bf16 tiles wrongly in tl.dot (its results are off by 1e8 where a cast
# to fp32 first is exact): under it, bf16 runs its dots in fp32; a GPU runs them in bf16.
BLOCK_N = 32  # keys a tile


if triton is not None:
    # the running max starts here, not at -inf: a tile with no visible key then adds exp(-inf) = 0. A kernel
    # may read a module global only as a tl.constexpr (Triton's interpreter reads any; the compiler refuses)
    NEG = tl.constexpr(-1.0e30)

    @triton.jit
    def _slot_attention_kernel(
        q_ptr, k_ptr, v_ptr,  # q [B, H, Q, D]; caches [S, KVH, L, D]
        acc_ptr, max_ptr, sum_ptr,  # per split: acc [B, H, P, Q, D], running max and sum [B, H, P, Q] (fp32)
        slots_ptr, positions_ptr, kv_lens_ptr, key_starts_ptr, block_starts_ptr, tree_ptr,
        sqb, sqh, sqq, sqd,
        sks, skh, skl, skd,
        svs, svh, svl, svd,
        num_kv_heads, queries, dim, group, num_splits, keys_per_split, scale, window,
        HAS_TREE: tl.constexpr, HAS_WINDOW: tl.constexpr, FP32_DOTS: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        pid = tl.program_id(0).to(tl.int64)
        split = tl.program_id(1).to(tl.int64)
        b = pid // num_kv_heads
        g = pid % num_kv_heads
        m = tl.arange(0, BLOCK_M)
        d = tl.arange(0, BLOCK_D)
        head = g * group + m // queries  # the query head of tile row m
        qi = m % queries  # its query
        row_ok = m < group * queries
        d_ok = d < dim

        q = tl.load(q_ptr + b * sqb + head[:, None] * sqh + qi[:, None] * sqq + d[None, :] * sqd,
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        slot = tl.load(slots_ptr + b).to(tl.int64)
        kv_len = tl.load(kv_lens_ptr + b)
        key_start = tl.load(key_starts_ptr + b)
        qpos = tl.load(positions_ptr + b * queries + qi, mask=row_ok, other=0)
        if HAS_TREE:
            block_start = tl.load(block_starts_ptr + b)

        lo = tl.maximum(split * keys_per_split, key_start)
        hi = tl.minimum((split + 1) * keys_per_split, kv_len)
        run_max = tl.full([BLOCK_M], NEG, tl.float32)
        run_sum = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for start in range(lo, hi, BLOCK_N):
            n = start + tl.arange(0, BLOCK_N)
            n_ok = n < hi
            k = tl.load(k_ptr + slot * sks + g * skh + n[:, None] * skl + d[None, :] * skd,
                        mask=n_ok[:, None] & d_ok[None, :], other=0.0)
            if FP32_DOTS:
                scores = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
            else:
                scores = tl.dot(q, tl.trans(k))
            scores = scores * scale
            seen = n_ok[None, :] & row_ok[:, None]
            if HAS_TREE:
                offset = n - block_start
                in_block = offset >= 0
                tree = tl.load(tree_ptr + (b * queries + qi[:, None]) * queries + offset[None, :],
                               mask=seen & in_block[None, :] & (offset[None, :] < queries), other=0)
                seen = seen & ((~in_block)[None, :] | (tree != 0))
            else:
                seen = seen & (n[None, :] <= qpos[:, None])
            if HAS_WINDOW:
                seen = seen & (n[None, :] > qpos[:, None] - window)
            scores = tl.where(seen, scores, float("-inf"))
            new_max = tl.maximum(run_max, tl.max(scores, axis=1))
            p = tl.exp(scores - new_max[:, None])
            alpha = tl.exp(run_max - new_max)
            run_sum = run_sum * alpha + tl.sum(p, axis=1)
            v = tl.load(v_ptr + slot * svs + g * svh + n[:, None] * svl + d[None, :] * svd,
                        mask=n_ok[:, None] & d_ok[None, :], other=0.0)
            if FP32_DOTS:
                acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            run_max = new_max

        # partial results of this split: [B, H, P, Q, (D)], row m = (head, query)
        part = ((b * num_kv_heads * group + head) * num_splits + split) * queries + qi
        tl.store(acc_ptr + part[:, None] * dim + d[None, :], acc, mask=row_ok[:, None] & d_ok[None, :])
        tl.store(max_ptr + part, run_max, mask=row_ok)
        tl.store(sum_ptr + part, run_sum, mask=row_ok)


def slot_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                   positions: torch.Tensor, kv_lens: torch.Tensor, key_starts: torch.Tensor | None = None,
                   window: int | None = None, tree_mask: torch.Tensor | None = None,
                   block_starts: torch.Tensor | None = None, scale: float | None = None,
                   num_splits: int | None = None, max_keys: int | None = None) -> torch.Tensor:
    """q [B, H, Q, D] (any strides); k_cache, v_cache [S, KVH, L, D]; slots, kv_lens (and key_starts,
    block_starts) [B]; positions [B, Q]; tree_mask [B, Q, Q] bool -> [B, H, Q, D] in q's dtype.
    `num_splits`: key ranges run in parallel (default: enough for about 256 keys each, at most 16).
    `max_keys`: at least kv_lens.max(), from the host: without it that is read back from the device, which a
    CUDA graph cannot capture; splits past a row's keys return at once."""
    if triton is None:
        raise RuntimeError("slot_attention needs Triton")
    check_kernel_devices("slot_attention", q=q, k_cache=k_cache, v_cache=v_cache, slots=slots, positions=positions,
                         kv_lens=kv_lens, key_starts=key_starts, tree_mask=tree_mask, block_starts=block_starts)
    rows, heads, queries, dim = q.shape
    kv_heads = k_cache.shape[1]
    group = heads // kv_heads
    device = q.device
    longest = max_keys if max_keys is not None else int(kv_lens.max())
    if num_splits is None:
        num_splits = max(1, min(16, triton.cdiv(longest, 256)))
    keys_per_split = triton.cdiv(triton.cdiv(longest, num_splits), BLOCK_N) * BLOCK_N
    acc = torch.empty(rows, heads, num_splits, queries, dim, dtype=torch.float32, device=device)
    run_max = torch.empty(rows, heads, num_splits, queries, dtype=torch.float32, device=device)
    run_sum = torch.empty_like(run_max)
    as_long = {"dtype": torch.int64, "device": device}
    key_starts = key_starts.to(**as_long) if key_starts is not None else torch.zeros(rows, **as_long)
    has_tree = tree_mask is not None
    tree = tree_mask.to(torch.int8).contiguous() if has_tree else key_starts  # (unread without a tree)
    block_starts = block_starts.to(**as_long) if has_tree else key_starts
    block_m = max(16, triton.next_power_of_2(group * queries))
    block_d = max(16, triton.next_power_of_2(dim))
    _slot_attention_kernel[(rows * kv_heads, num_splits)](
        q, k_cache, v_cache, acc, run_max, run_sum,
        slots.to(**as_long), positions.to(**as_long).contiguous(), kv_lens.to(**as_long), key_starts, block_starts,
        tree,
        *q.stride(), *k_cache.stride(), *v_cache.stride(),
        kv_heads, queries, dim, group, num_splits, keys_per_split,
        scale if scale is not None else dim**-0.5, window if window is not None else 0,
        HAS_TREE=has_tree, HAS_WINDOW=window is not None, FP32_DOTS=q.dtype == torch.float32 or (
            q.dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1"),
        BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_D=block_d,
    )
    # merge the splits: each summed exp(score - its own max); rescale all to the largest max
    top = run_max.max(dim=2, keepdim=True).values
    weight = torch.exp(run_max - top)  # [B, H, P, Q]
    total = (run_sum * weight).sum(dim=2)  # [B, H, Q]
    out = (acc * weight[..., None]).sum(dim=2) / torch.where(total > 0, total, 1.0)[..., None]
    return out.to(q.dtype)
