"""Attention of a few new queries per row over the KV cache (decode, verify, draft steps), fast on CPU.

On CPU, SDPA's kernels are built for long queries: for the engine's shapes, few queries per row against a few
hundred cached keys under a mask, they spend most of their time outside the arithmetic. On the dev VM (8
query heads over 2 KV heads, head_dim 64, 300 keys), 8 rows x 5 queries took 388 us per layer and 32 rows x
2 queries 958 us; two batched matmuls with the query heads of each KV group stacked as rows of one matrix
(so the keys are read once per group and never expanded), a masked softmax between them, take 250 and 455
us. Small batches (one row decoding) keep SDPA, and so does CUDA, where its fused kernels are the fast path;
prompts from position 0 take the C++ prompt kernel on CPU (`prompt_attention`), else SDPA's causal kernel.
Rows of up to 16 queries attend through the slot kernels instead where they run (`batch_attention`; the C++
one on CPU: models/slot_attention_cpu.cpp); these forms are what runs without them (`DRAFTSMITH_ATTENTION=torch`,
or a CPU where the kernel does not build) and for longer rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from draftsmith.models.kernel_backend import cpu_attention_kernel_wanted
from draftsmith.models.prompt_attention import kernel_applies, padded_prompt_attention
from draftsmith.models.slot_attention_cpu import slot_attention_cpu

GROUPED_UP_TO = 16  # queries per row: longer rows (prompt chunks) use the prompt kernel or SDPA's flash kernel
# queries in the batch from which the grouped form beats SDPA; below, SDPA is faster (measurements:
# docs/decisions/cpu-kernels.md) ...
GROUPED_FROM = 8
# ... unless the rows read this many keys or more, in fp32: then the grouped form wins from one query on
GROUPED_KEYS_FROM = 128
# queries per row from which a traced step's weighted sum of values is a batched GEMM over the values copied
# out of the cache (`reduced_attention`): Inductor's sum reads each value row again for every query
REDUCED_GEMM_FROM = 4


def cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                     memo: dict | None = None) -> torch.Tensor:
    """q [B, heads, Q, D]; k, v [B, kv_heads, K, D] (strided views of the cache are fine); mask [B, 1, Q, K]
    bool, True = may attend -> [B, heads, Q, D]. `memo`: a dict living as long as `mask` (the forward's
    batch), where what every layer would derive from the mask alike is kept."""
    rows, heads, queries, dim = q.shape
    kv_heads = k.shape[1]
    if torch.compiler.is_compiling() and q.device.type == "cpu" and q.dtype == k.dtype == v.dtype == torch.float32 \
            and not heads % kv_heads:
        return reduced_attention(q, k, v, mask)
    few = rows * queries < GROUPED_FROM and (q.dtype != torch.float32 or k.shape[2] < GROUPED_KEYS_FROM)
    if q.device.type != "cpu" or queries > GROUPED_UP_TO or few or heads % kv_heads:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    return grouped_attention(q, k, v, mask, memo)


def grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                      memo: dict | None = None) -> torch.Tensor:
    """The matmul form of `cached_attention` (any device): query head h belongs to KV head h // group, as in
    SDPA's enable_gqa and HF's repeat_kv."""
    rows, heads, queries, dim = q.shape
    kv_heads, keys = k.shape[1], k.shape[2]
    group = heads // kv_heads
    dtype = v.dtype
    if dtype == torch.float32 and q.dtype == k.dtype == dtype:
        # The mask as an additive bias, expanded to the score matrices' layout once per forward (`memo`) and
        # added by the first matmul itself (baddbmm, with the scale): one pass over the scores, not three.
        key = ("bias", rows, kv_heads, group, queries, keys)
        bias = memo.get(key) if memo is not None else None
        if bias is None:
            bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(
                ~mask, torch.finfo(dtype).min)  # a large negative, not -inf: a row with no key stays finite
            bias = bias[:, :, None].expand(rows, kv_heads, group, queries, keys).reshape(
                rows * kv_heads, group * queries, keys)
            if memo is not None:
                memo[key] = bias
        scores = torch.baddbmm(bias, q.reshape(rows * kv_heads, group * queries, dim),
                               k.reshape(rows * kv_heads, keys, dim).transpose(1, 2), alpha=dim**-0.5)
        weights = torch.softmax(scores, dim=-1)
        return torch.bmm(weights, v.reshape(rows * kv_heads, keys, dim)).view(rows, heads, queries, dim)
    if q.device.type == "cpu" and dtype != torch.float32:
        # CPU bf16 matmuls go to oneDNN, which compiles a kernel for each new shape, and the key count moves
        # every step; in fp32 the same small products run on MKL, compiled once.
        q, k, v = q.float(), k.float(), v.float()
    # rounded to the inputs' dtype where a matmul in it would round: the same drafts as in that dtype
    scores = torch.matmul(q.reshape(rows, kv_heads, group * queries, dim), k.transpose(-1, -2)).to(dtype) * dim**-0.5
    # a large negative, not -inf: a query with no key to attend (padding) gets a finite average, not NaN
    scores = scores.view(rows, kv_heads, group, queries, keys).masked_fill(
        ~mask[:, :, None], torch.finfo(scores.dtype).min)
    weights = torch.softmax(scores.float(), dim=-1).to(dtype).view(rows, kv_heads, group * queries, keys)
    return torch.matmul(weights.to(v.dtype), v).to(dtype).view(rows, heads, queries, dim)


def reduced_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`cached_attention` as products summed, for a step torch.compile traces on CPU: Inductor turns both
    sums into loops of its own and folds the read of each row's keys and values from the cache (a static
    batch gathers them by slot) into those loops, where the matmul form's batched GEMMs made it copy every
    row's window out of the cache first, in every layer. From REDUCED_GEMM_FROM queries a row (verifies of 3
    drafts or more) the values' sum is a GEMM again. Eagerly the products would be materialized whole."""
    rows, heads, queries, dim = q.shape
    kv_heads, keys = k.shape[1], k.shape[2]
    group = heads // kv_heads
    grouped_q = q.reshape(rows, kv_heads, group * queries, 1, dim)
    scores = (grouped_q * k[:, :, None]).sum(-1) * dim**-0.5  # [rows, kv_heads, group * queries, keys]
    # a large negative, not -inf: a query with no key to attend (padding) gets a finite average, not NaN
    scores = scores.view(rows, kv_heads, group, queries, keys).masked_fill(~mask[:, :, None],
                                                                            torch.finfo(scores.dtype).min)
    weights = torch.softmax(scores, dim=-1).view(rows, kv_heads, group * queries, keys, 1)
    if queries >= REDUCED_GEMM_FROM:
        out = torch.matmul(weights.view(rows, kv_heads, group * queries, keys), v)
        return out.view(rows, heads, queries, dim)
    return (weights * v[:, :, None]).sum(-2).view(rows, heads, queries, dim)


@torch.compiler.assume_constant_result
def _cpu_kernel_wanted() -> bool:
    """`cpu_attention_kernel_wanted`, read once when a step is traced (a compiled runner keeps its choice)."""
    return cpu_attention_kernel_wanted()


def batch_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch) -> torch.Tensor:
    """A forward's attention over the layer's cache, its new keys and values already written: the slot kernel
    where the batch was built for it (`ForwardBatch.slot_rows`: Triton on CUDA, C++ on CPU by default),
    reading the slots in place; elsewhere the rows' keys read out and `cached_attention` over the batch's
    mask."""
    rows = batch.slot_rows
    if batch.causal and rows is None and q.shape[2] > GROUPED_UP_TO:
        # prompts from position 0 (first chunks): the C++ prompt kernel on CPU, else SDPA's causal kernel;
        # both skip the keys past each query block and read no mask; a row's keys past its length are only
        # seen by its padding queries
        if kernel_applies(q):
            return padded_prompt_attention(q, k_cache, v_cache, batch.read_slots.tolist())
        return F.scaled_dot_product_attention(q, batch.read(k_cache), batch.read(v_cache), is_causal=True,
                                              enable_gqa=True)
    if rows is not None:
        positions = batch.positions if rows.positions is None else rows.positions
        return slot_kernel_attention(q, k_cache, v_cache, batch.read_slots, positions, rows.kv_lens,
                                     key_starts=rows.key_starts, window=rows.window, max_keys=rows.max_keys,
                                     tree_mask=rows.tree_mask, block_starts=rows.block_starts)
    return cached_attention(q, batch.read(k_cache), batch.read(v_cache), batch.mask, batch.memo)


def packed_slot_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch) -> torch.Tensor | None:
    """A packed forward's attention on its real queries as they are, q [T, H, D] -> [T, H, D], where the C++
    slot kernel runs the batch (a CPU batch built for the slot kernel, no tree); None elsewhere: the caller
    unpacks q to [B, H, Q, D] for `batch_attention`. Unpacking q and gathering the output back cost each
    layer of a packed verify two copies of the padded layout."""
    rows = batch.slot_rows
    if rows is None or rows.tree_mask is not None or q.device.type != "cpu" or not _cpu_kernel_wanted():
        return None
    positions = batch.positions if rows.positions is None else rows.positions
    return slot_attention_cpu(q, k_cache, v_cache, batch.read_slots, positions, rows.kv_lens,
                              key_starts=rows.key_starts, window=rows.window, block_starts=rows.block_starts,
                              query_starts=batch.query_starts())


def slot_kernel_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                          positions: torch.Tensor, kv_lens: torch.Tensor, key_starts: torch.Tensor | None = None,
                          window: int | None = None, max_keys: int | None = None,
                          tree_mask: torch.Tensor | None = None,
                          block_starts: torch.Tensor | None = None) -> torch.Tensor:
    """The slot kernel a batch with `slot_rows` was built for (arguments as `slot_attention_reference`;
    positions [B, q's queries]): the C++ one for CPU tensors where it runs, else the Triton one."""
    if q.device.type == "cpu" and _cpu_kernel_wanted():
        return slot_attention_cpu(q, k_cache, v_cache, slots, positions, kv_lens, key_starts=key_starts,
                                  window=window, tree_mask=tree_mask, block_starts=block_starts)
    from draftsmith.models.slot_attention_triton import slot_attention

    return slot_attention(q, k_cache, v_cache, slots, positions, kv_lens, key_starts=key_starts, window=window,
                          max_keys=max_keys, tree_mask=tree_mask, block_starts=block_starts)
