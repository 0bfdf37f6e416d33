"""models/attention.py: the grouped-matmul attention the engine runs on CPU equals SDPA's (the reference),
for the masks the engine builds: causal over a cache, per-row lengths, a sliding window, padding queries."""

import pytest
import torch
import torch.nn.functional as F

from draftsmith.models.attention import (
    GROUPED_KEYS_FROM,
    GROUPED_UP_TO,
    REDUCED_GEMM_FROM,
    cached_attention,
    grouped_attention,
    reduced_attention,
)

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}  # bf16: SDPA and matmul round at different points


def _case(rows, heads, kv_heads, queries, keys, dtype, window=None):
    q = torch.randn(rows, heads, queries, 32).to(dtype)
    cache_k, cache_v = torch.randn(rows + 2, kv_heads, keys + 7, 32).to(dtype), torch.randn(rows + 2, kv_heads, keys + 7, 32).to(dtype)
    k, v = cache_k[1 : rows + 1, :, :keys], cache_v[1 : rows + 1, :, :keys]  # strided views, as read from a cache
    lengths = torch.randint(queries, keys + 1, (rows,))
    positions = lengths[:, None] - queries + torch.arange(queries)[None, :]  # each row's newest queries
    key_index = torch.arange(keys)[None, None, :]
    mask = key_index <= positions[:, :, None]
    if window is not None:
        mask &= key_index > positions[:, :, None] - window
    return q, k, v, mask[:, None]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,heads,kv_heads,queries,keys,window", [
    (1, 4, 4, 1, 9, None),  # one row, no grouping (cached_attention: SDPA)
    (1, 8, 2, 1, 300, None),  # one row over a long context: grouped in fp32
    (2, 4, 4, 4, 9, None),  # 8 queries: grouped
    (8, 8, 2, 1, 300, None),  # decode, GQA
    (8, 8, 2, 5, 300, None),  # verify
    (3, 6, 3, 4, 40, 7),  # sliding window
    (32, 8, 1, 2, 64, None),  # multi-query
])
def test_grouped_matches_sdpa(dtype, rows, heads, kv_heads, queries, keys, window):
    q, k, v, mask = _case(rows, heads, kv_heads, queries, keys, dtype, window)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    for got in (grouped_attention(q, k, v, mask), cached_attention(q, k, v, mask)):
        torch.testing.assert_close(got.float(), expected.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("rows,heads,kv_heads,queries,keys,window", [
    (1, 4, 4, 1, 9, None), (8, 8, 2, 1, 300, None), (8, 8, 2, 5, 300, None), (3, 6, 3, 4, 40, 7),
    (32, 8, 1, 2, 64, None),
])
def test_reduced_form_matches_sdpa(rows, heads, kv_heads, queries, keys, window):
    """The form compiled CPU steps trace (products summed, no batched matmul) computes what SDPA does."""
    q, k, v, mask = _case(rows, heads, kv_heads, queries, keys, torch.float32, window)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(reduced_attention(q, k, v, mask), expected, atol=1e-5, rtol=1e-5)


def test_a_query_with_no_key_stays_finite():
    """A padding query whose mask admits no key must not turn into NaN (it would reach the logits)."""
    q, k, v, mask = _case(2, 4, 2, 3, 10, torch.float32)
    mask[1, :, 2] = False
    assert torch.isfinite(grouped_attention(q, k, v, mask)).all()
    assert torch.isfinite(reduced_attention(q, k, v, mask)).all()


@pytest.mark.parametrize("queries", [1, REDUCED_GEMM_FROM])
def test_traced_cpu_attention_is_the_reduced_form(queries):
    """Under torch.compile on CPU, fp32 attention is traced as products and sums, which Inductor fuses with
    the read of the rows' keys from the cache (a batched matmul there made it copy them out first); from
    REDUCED_GEMM_FROM queries a row, only the values' weighted sum is a matmul."""
    q, k, v, mask = _case(8, 8, 2, queries, 300, torch.float32)
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    got = torch.compile(cached_attention, fullgraph=True, backend=keep)(q, k, v, mask)
    targets = [node.target for node in graphs[0].graph.nodes if node.op == "call_function"]
    assert not {torch.bmm, torch.baddbmm, F.scaled_dot_product_attention} & set(targets)
    assert targets.count(torch.matmul) == (queries >= REDUCED_GEMM_FROM)
    torch.testing.assert_close(got, cached_attention(q, k, v, mask), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_row_takes_the_grouped_form_from_grouped_keys_from_keys_in_fp32(dtype):
    for keys in (GROUPED_KEYS_FROM - 1, GROUPED_KEYS_FROM):
        q, k, v, mask = _case(1, 8, 2, 1, keys, dtype)
        grouped = keys >= GROUPED_KEYS_FROM and dtype == torch.float32
        expected = grouped_attention(q, k, v, mask) if grouped else \
            F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        assert torch.equal(cached_attention(q, k, v, mask), expected), (keys, dtype)


def test_long_queries_keep_sdpa():
    q, k, v, mask = _case(2, 4, 2, GROUPED_UP_TO + 1, 40, torch.float32)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    assert torch.equal(cached_attention(q, k, v, mask), expected)


def test_the_bias_kept_for_a_batch_is_reused_and_not_carried_to_another():
    """fp32 grouped attention keeps the mask's expanded bias in the batch's memo for the next layers; a
    batch derived with dataclasses.replace (a draft step's own mask) starts an empty memo."""
    import dataclasses

    from draftsmith.models.kv_cache import ForwardBatch, KVCache

    q, k, v, mask = _case(8, 8, 2, 3, 40, torch.float32)
    memo = {}
    first = grouped_attention(q, k, v, mask, memo)
    assert len(memo) == 1
    torch.testing.assert_close(first, grouped_attention(q, k, v, mask))
    torch.testing.assert_close(grouped_attention(q * 2, k, v, mask, memo), grouped_attention(q * 2, k, v, mask))
    assert len(memo) == 1  # same shape: reused
    cache = KVCache(1, 2, 16, 2, 8, torch.float32, "cpu")
    batch = ForwardBatch.build([0, 1], [3, 5], [2, 2], cache)
    batch.memo["x"] = 1
    assert dataclasses.replace(batch, mask=batch.mask[:, :, :1]).memo == {}
