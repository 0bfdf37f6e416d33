"""The C++ CPU slot attention kernel against the PyTorch reference (the rules both follow): GQA, ragged rows
in scattered slots, decode to 16 queries a row, key ranges, sliding windows, tree and all-True (DFlash) block
masks, strided queries, queries that see no key, fp32/bf16, and the op under torch.compile."""

import pytest
import torch

from draftsmith.models.slot_attention_cpu import build_error, slot_attention_cpu
from draftsmith.models.slot_attention_reference import slot_attention_reference

pytestmark = pytest.mark.skipif(build_error() is not None, reason=f"the CPU kernel did not build: {build_error()}")

TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


def _case(heads, kv_heads, dim, q_lens, starts, dtype=torch.float32, seed=0, slots_total=6, max_len=700):
    generator = torch.Generator().manual_seed(seed)
    rows, width = len(q_lens), max(q_lens)
    k_cache = torch.randn(slots_total, kv_heads, max_len, dim, generator=generator).to(dtype)
    v_cache = torch.randn(slots_total, kv_heads, max_len, dim, generator=generator).to(dtype)
    # a query laid out as the model's projection leaves it, [B, Q, H, D] seen as [B, H, Q, D]: not contiguous
    q = (3 * torch.randn(rows, width, heads, dim, generator=generator)).to(dtype).transpose(1, 2)
    slots = torch.tensor([(3 * i + 1) % slots_total for i in range(rows)])  # scattered, not in order
    positions = torch.tensor(starts)[:, None] + torch.arange(width)
    kv_lens = torch.tensor([s + n for s, n in zip(starts, q_lens)])
    return q, k_cache, v_cache, slots, positions, kv_lens


def _check(got, want, q_lens, dtype=torch.float32):
    for b, n in enumerate(q_lens):  # padding queries past a row's own are not compared
        torch.testing.assert_close(got[b, :, :n].float(), want[b, :, :n].float(), atol=TOLERANCE[dtype],
                                   rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("heads,kv_heads,dim", [(8, 2, 64), (4, 4, 32), (6, 2, 48), (2, 1, 128)])
@pytest.mark.parametrize("q_lens", [[1, 1, 1, 1], [5, 2, 16, 1]])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_causal_rows_match_the_reference(heads, kv_heads, dim, q_lens, dtype):
    # keys from 1 to past a block of 64 and past several: the online softmax's merges across blocks; a bf16
    # cache's blocks are widened to fp32 where head_dim is a multiple of 64, read element by element elsewhere
    q, k, v, slots, positions, kv_lens = _case(heads, kv_heads, dim, q_lens, starts=[0, 63, 300, 641], dtype=dtype)
    got = slot_attention_cpu(q, k, v, slots, positions, kv_lens)
    _check(got, slot_attention_reference(q, k, v, slots, positions, kv_lens), q_lens, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_key_ranges_and_windows(dtype):
    q_lens, starts = [4, 1, 9], [500, 130, 61]
    q, k, v, slots, positions, kv_lens = _case(8, 2, 64, q_lens, starts, dtype, seed=1)
    key_starts = torch.tensor([100, 0, 60])
    for window in (None, 50, 200):
        want = slot_attention_reference(q, k, v, slots, positions, kv_lens, key_starts=key_starts, window=window)
        got = slot_attention_cpu(q, k, v, slots, positions, kv_lens, key_starts=key_starts, window=window)
        assert got.dtype == dtype
        _check(got, want, q_lens, dtype)


def test_tree_and_block_masks():
    q_lens, starts = [7, 16], [90, 250]
    q, k, v, slots, positions, kv_lens = _case(8, 2, 64, q_lens, starts, seed=2)
    generator = torch.Generator().manual_seed(3)
    tree = (torch.rand(2, 16, 16, generator=generator) < 0.4) | torch.eye(16, dtype=torch.bool)
    block_starts = torch.tensor(starts)
    for mask in (tree, torch.ones_like(tree)):  # a tree; DFlash's block, every query sees all of it
        want = slot_attention_reference(q, k, v, slots, positions, kv_lens, tree_mask=mask, block_starts=block_starts)
        got = slot_attention_cpu(q, k, v, slots, positions, kv_lens, tree_mask=mask, block_starts=block_starts)
        _check(got, want, q_lens)


@pytest.mark.parametrize("heads,kv_heads,dim,position", [(8, 2, 64, 650), (6, 2, 48, 129), (4, 4, 32, 70)])
def test_a_query_scores_alike_alone_and_among_a_verify_s_queries(heads, kv_heads, dim, position):
    """Decoding scores one query a row and verifying several: the kernel scores two score rows by four keys at a
    time where it can, and one by one at the edges (odd rows, a block's last keys). A query's output is the
    same number either way, so that a verify's last query is exactly the decode step it stands for."""
    generator = torch.Generator().manual_seed(6)
    k_cache = torch.randn(2, kv_heads, 700, dim, generator=generator)
    v_cache = torch.randn(2, kv_heads, 700, dim, generator=generator)
    q = torch.randn(1, heads, 5, dim, generator=generator)
    slots, kv_lens = torch.tensor([1]), torch.tensor([position + 1])
    verify = slot_attention_cpu(q, k_cache, v_cache, slots, position - 4 + torch.arange(5)[None], kv_lens)
    alone = slot_attention_cpu(q[:, :, 4:].contiguous(), k_cache, v_cache, slots, torch.tensor([[position]]), kv_lens)
    assert torch.equal(verify[:, :, 4:], alone)


def test_a_query_that_sees_no_key_gets_zeros():
    q, k, v, slots, positions, kv_lens = _case(4, 2, 32, [2, 1], [10, 20], seed=4)
    key_starts = torch.tensor([200, 0])  # row 0's keys start past its queries
    got = slot_attention_cpu(q, k, v, slots, positions, kv_lens, key_starts=key_starts)
    assert torch.equal(got[0], torch.zeros_like(got[0]))
    want = slot_attention_reference(q, k, v, slots, positions, kv_lens, key_starts=key_starts)
    _check(got, want, [2, 1])


def test_padding_queries_are_not_scored():
    """A row's queries after its last below its kv_len are padding (a verify row with fewer drafts than the
    batch's widest): skipped, their outputs zeros, the row's real queries as the reference has them."""
    q_lens = [5, 1, 3, 1]
    q, k, v, slots, positions, kv_lens = _case(8, 2, 64, q_lens, starts=[40, 300, 7, 650], seed=6)
    got = slot_attention_cpu(q, k, v, slots, positions, kv_lens)
    for b, n in enumerate(q_lens):
        assert torch.equal(got[b, :, n:], torch.zeros_like(got[b, :, n:]))
        assert got[b, :, :n].abs().sum() > 0
    _check(got, slot_attention_reference(q, k, v, slots, positions, kv_lens), q_lens)


@pytest.mark.parametrize("key_starts,window", [(None, None), ([0, 200, 3, 600], None), (None, 50)])
def test_packed_queries_score_as_their_padded_rows(key_starts, window):
    """q as a packed verify holds it ([T, H, D], row b's real queries from query_starts[b]): each query's output
    is the padded call's, bit for bit, and the reference's."""
    q_lens = [5, 1, 3, 1]
    q, k, v, slots, positions, kv_lens = _case(8, 2, 64, q_lens, starts=[40, 300, 7, 650], seed=7)
    starts = None if key_starts is None else torch.tensor(key_starts)
    padded = slot_attention_cpu(q, k, v, slots, positions, kv_lens, key_starts=starts, window=window)
    packed_q = torch.cat([q[b, :, :n].transpose(0, 1) for b, n in enumerate(q_lens)])  # [T, H, D]
    query_starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()])
    packed = slot_attention_cpu(packed_q, k, v, slots, positions, kv_lens, key_starts=starts, window=window,
                                query_starts=query_starts)
    assert packed.shape == packed_q.shape
    for b, n in enumerate(q_lens):
        assert torch.equal(packed[query_starts[b] : query_starts[b] + n].transpose(0, 1), padded[b, :, :n])
    want = slot_attention_reference(q, k, v, slots, positions, kv_lens, key_starts=starts, window=window)
    _check(padded, want, q_lens)


def test_packed_query_starts_past_a_row_are_one_line():
    q, k, v, slots, positions, kv_lens = _case(4, 2, 32, [2, 1], [10, 20], seed=8)
    packed_q = q[:, :, :2].transpose(1, 2).reshape(4, 4, 32)
    with pytest.raises(RuntimeError, match="query_starts run from 0 to q's T"):
        slot_attention_cpu(packed_q, k, v, slots, positions, kv_lens, query_starts=torch.tensor([0, 3, 4]))


def test_the_op_runs_inside_a_compiled_function():
    q_lens = [1, 3]
    q, k, v, slots, positions, kv_lens = _case(8, 2, 64, q_lens, starts=[77, 400], seed=5)

    def step(q, k, v, slots, positions, kv_lens):  # as a compiled step: work before and after the kernel
        return slot_attention_cpu(q * 1.0, k, v, slots, positions, kv_lens) + 1.0

    got = torch.compile(step, fullgraph=True, backend="aot_eager")(q, k, v, slots, positions, kv_lens)
    _check(got - 1.0, slot_attention_reference(q, k, v, slots, positions, kv_lens), q_lens)


@pytest.mark.slow
def test_the_engine_decodes_and_verifies_through_the_kernel(monkeypatch, target, greedy_reference):
    """By default on CPU (`auto`) every decode and verify forward of the demo model attends through the C++
    kernel (prefill chunks wider than 16 queries keep PyTorch's); greedy n-gram speculation gives plain
    decoding's tokens, and so does plain decoding through PyTorch's attention."""
    from draftsmith.models import attention
    from draftsmith.serve import LLM
    from helpers import DEMO_MODEL, greedy_token_ids, spec_config

    calls = []
    real = attention.slot_attention_cpu
    monkeypatch.setattr(attention, "slot_attention_cpu", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    monkeypatch.delenv("DRAFTSMITH_ATTENTION", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # as served: no Triton kernel can run on CPU
    llm = LLM(DEMO_MODEL, dtype="float32", device="cpu", max_num_seqs=3, max_model_len=256, target=target,
              enforce_eager=True, speculative_config=spec_config("ngram", k=3, prompt_lookup_min=1, prompt_lookup_max=3))
    assert greedy_token_ids(llm) == greedy_reference
    assert llm.get_metrics()["num_accepted_tokens"] > 0
    assert any(shape[2] == 1 for shape in calls) and any(shape[2] > 1 for shape in calls)
    monkeypatch.setenv("DRAFTSMITH_ATTENTION", "torch")
    calls.clear()
    plain = LLM(DEMO_MODEL, dtype="float32", device="cpu", max_num_seqs=3, max_model_len=256, target=target,
                enforce_eager=True)
    assert greedy_token_ids(plain) == greedy_reference
    assert not calls
