"""Per-slot cache mechanics: padding never touches live slots, rewinding drops tokens without copies."""

import torch

from draftsmith.models import ForwardBatch, load_target
from draftsmith.models.kv_cache import KVCache
from helpers import make_tiny_checkpoint


def test_padding_writes_go_to_scratch_slot(tmp_path):
    make_tiny_checkpoint("llama", tmp_path)
    model = load_target(tmp_path, dtype="float32")
    cache = model.make_cache(num_slots=2, max_len=32)
    batch = ForwardBatch.build([0, 1], [0, 0], [5, 2], cache)
    with torch.no_grad():
        model(torch.randint(0, 128, (2, 5)), cache=cache, batch=batch)
    for layer_k in cache.k:
        assert layer_k[0, :, :5].abs().sum() > 0
        assert layer_k[1, :, :2].abs().sum() > 0
        assert layer_k[1, :, 2:].abs().sum() == 0  # row 1's three padding tokens went elsewhere
        assert layer_k[cache.scratch_slot].abs().sum() > 0


def test_rewound_sequence_equals_fresh_sequence(tmp_path):
    """What speculation needs: write 6 tokens, keep 3, write 3 others; logits equal a clean run."""
    make_tiny_checkpoint("qwen3", tmp_path)
    model = load_target(tmp_path, dtype="float32")
    prefix, rejected, accepted = (torch.randint(0, 128, (1, n)) for n in (7, 6, 3))
    cache = model.make_cache(num_slots=1, max_len=32)
    with torch.no_grad():
        model(prefix, cache=cache, batch=ForwardBatch.build([0], [0], [7], cache))
        model(rejected, cache=cache, batch=ForwardBatch.build([0], [7], [6], cache))
        # keep rejected[:3], drop the rest by simply continuing from position 10
        tail = model(accepted, cache=cache, batch=ForwardBatch.build([0], [10], [3], cache)).logits
        fresh = model(torch.cat([prefix, rejected[:, :3], accepted], dim=1)).logits[:, -3:]
    torch.testing.assert_close(tail, fresh, atol=1e-5, rtol=0)


def test_contiguous_slots_read_a_view_and_scattered_slots_gather(tmp_path):
    make_tiny_checkpoint("llama", tmp_path)
    model = load_target(tmp_path, dtype="float32")
    cache = model.make_cache(num_slots=4, max_len=16)
    assert ForwardBatch.build([1, 2, 3], [0, 0, 0], [1, 1, 1], cache).slot_start == 1
    scattered = ForwardBatch.build([3, 0], [0, 0], [1, 1], cache)
    assert scattered.slot_start is None
    cache.k[0][3, :, 0] = 7.0
    assert (scattered.read(cache.k[0])[0, :, 0] == 7.0).all()


def test_keys_no_row_can_see_are_not_read(tmp_path):
    """A sliding window and key_starts (a draft head's context) narrow the keys read to those some query
    may see, with the same result as masking them over the whole prefix."""
    make_tiny_checkpoint("mistral-window", tmp_path)  # sliding window 8
    model = load_target(tmp_path, dtype="float32")
    cache = model.make_cache(num_slots=2, max_len=64)
    ids = torch.randint(0, 128, (2, 30))
    with torch.no_grad():
        model(ids[:, :28], cache=cache, batch=ForwardBatch.build([0, 1], [0, 0], [28, 28], cache, sliding_window=8))
        windowed = ForwardBatch.build([0, 1], [28, 28], [2, 2], cache, sliding_window=8)
        assert windowed.kv_start == 28 - 8 + 1 and windowed.read(cache.k[0]).shape[2] == 30 - windowed.kv_start
        tail = model(ids[:, 28:], cache=cache, batch=windowed).logits
        fresh = model(ids).logits[:, -2:]
    torch.testing.assert_close(tail, fresh, atol=1e-5, rtol=0)

    head = ForwardBatch.build([0, 1], [28, 25], [2, 2], cache, key_starts=[20, 12])
    assert head.kv_start == 12 and head.mask.shape[-1] == 30 - 12
    full = ForwardBatch.build([0, 1], [28, 25], [2, 2], cache)
    full.mask &= (torch.arange(30) >= torch.tensor([20, 12])[:, None])[:, None, None, :]  # same rule, all keys
    q = torch.randn(2, 4, 2, 16)

    def attend(batch):
        return torch.nn.functional.scaled_dot_product_attention(
            q, batch.read(cache.k[0]), batch.read(cache.v[0]), attn_mask=batch.mask, enable_gqa=True)

    torch.testing.assert_close(attend(head), attend(full))


def test_rows_far_apart_read_their_own_windows():
    """Draft-head rows hundreds of positions apart gather each row's own context window (key_positions)
    instead of reading every key between the first context start and the last position; attention over the
    gathered keys equals attention over all keys under the same mask, also for a window past the cache's end."""
    cache = KVCache(1, num_slots=3, max_len=64, num_kv_heads=2, head_dim=16, dtype=torch.float32, device="cpu")
    cache.k[0].normal_()
    cache.v[0].normal_()
    slots, starts, q_lens, key_starts = [2, 0], [50, 8], [3, 2], [45, 2]
    gathered = ForwardBatch.build(slots, starts, q_lens, cache, key_starts=key_starts)
    assert gathered.key_positions is not None and gathered.read(cache.k[0]).shape[2] == 53 - 45
    full = ForwardBatch.build(slots, starts, q_lens, cache)
    full.mask &= (torch.arange(53) >= torch.tensor(key_starts)[:, None])[:, None, None, :]
    q = torch.randn(2, 4, 3, 16)

    def attend(batch):
        return torch.nn.functional.scaled_dot_product_attention(
            q, batch.read(cache.k[0]), batch.read(cache.v[0]), attn_mask=batch.mask, enable_gqa=True)

    torch.testing.assert_close(attend(gathered)[0], attend(full)[0])
    torch.testing.assert_close(attend(gathered)[1, :, :2], attend(full)[1, :, :2])  # its third query is padding
    # row 0's window would run past the cache (keys 45..65 of 64): those keys are masked, not read twice
    edge = ForwardBatch.build([2, 0], [61, 8], [3, 2], cache, key_starts=[45, 2])
    assert edge.key_positions is not None and int(edge.key_positions.max()) == 63
    edge_full = ForwardBatch.build([2, 0], [61, 8], [3, 2], cache)
    edge_full.mask &= (torch.arange(64) >= torch.tensor([45, 2])[:, None])[:, None, None, :]
    torch.testing.assert_close(attend(edge)[0], attend(edge_full)[0])


def test_prompts_from_position_zero_attend_causally_without_a_mask():
    """Rows that all start at position 0 (first prompt chunks) attend with SDPA's causal kernel instead of
    reading the [B, Q, K] mask: the same result for every real query; any other start, a sliding window or
    a draft head's key_starts keeps the mask."""
    from draftsmith.models.attention import batch_attention, cached_attention

    cache = KVCache(1, 3, 64, 2, 16, torch.float32, "cpu")
    cache.k[0].normal_(), cache.v[0].normal_()
    q_lens = [40, 23]
    batch = ForwardBatch.build([2, 0], [0, 0], q_lens, cache)
    assert batch.causal
    q = torch.randn(2, 4, 40, 16)
    expected = cached_attention(q, batch.read(cache.k[0]), batch.read(cache.v[0]), batch.mask)
    batch.mask = None  # the causal path reads no mask: with none to read, only it can answer
    got = batch_attention(q, cache.k[0], cache.v[0], batch)
    for row, n in enumerate(q_lens):
        torch.testing.assert_close(got[row, :, :n], expected[row, :, :n])
    assert not ForwardBatch.build([2, 0], [0, 5], q_lens, cache).causal
    assert not ForwardBatch.build([2, 0], [0, 0], q_lens, cache, sliding_window=8).causal
    assert not ForwardBatch.build([2, 0], [0, 0], q_lens, cache, key_starts=[0, 0]).causal


def test_long_rows_pack_at_any_padding_and_short_rows_past_a_fifth():
    """Prompt chunks (rows of PACK_ALWAYS_FROM queries or more) attend one by one, so any padding is
    per-token work for nothing and they pack; shorter rows (verifies) pack once padding passes a fifth."""
    from draftsmith.models.kv_cache import PACK_ALWAYS_FROM, ROW_ATTENTION_FROM

    cache = KVCache(1, 2, 256, 2, 16, torch.float32, "cpu")
    long = PACK_ALWAYS_FROM
    assert ForwardBatch.build([0, 1], [0, 0], [long, long - 1], cache, pack=True).row_spans is not None
    assert ForwardBatch.build([0, 1], [0, 0], [long, long], cache, pack=True).tokens is None  # nothing to drop
    wide = ROW_ATTENTION_FROM  # a wide verify, 15 of 16 real: stays padded
    assert ForwardBatch.build([0, 1], [9, 9], [wide, wide - 1], cache, pack=True).tokens is None
    assert ForwardBatch.build([0, 1], [9, 9], [4, 3], cache, pack=True).tokens is None  # 7 of 8: padded
    short = ForwardBatch.build([0, 1], [9, 9], [4, 2], cache, pack=True)
    assert short.tokens is not None and short.row_spans is None


def test_listed_and_tensor_built_batches_are_the_same(monkeypatch):
    """A small batch's positions, write slots and packed token index are listed on the host, a large one's made
    by tensor ops: the same values either way (positions past the cache's end at its last, padding queries
    writing the scratch slot)."""
    from draftsmith.models import kv_cache

    cache = KVCache(1, 8, 64, 2, 8, torch.float32, "cpu")
    cases = [([0], [10], [1]), ([3, 1], [5, 60], [4, 2]), ([0, 1, 2], [0, 7, 62], [9, 1, 5]),
             ([4, 6], [20, 30], [16, 3])]
    for slots, starts, q_lens in cases:
        listed = ForwardBatch.build(slots, starts, q_lens, cache, pack=True)
        monkeypatch.setattr(kv_cache, "LISTED_UP_TO", 0)
        made = ForwardBatch.build(slots, starts, q_lens, cache, pack=True)
        monkeypatch.undo()
        for field in ("positions", "write_slots", "read_slots", "mask", "tokens"):
            a, b = getattr(listed, field), getattr(made, field)
            assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), (field, slots, starts, q_lens)
        width = max(q_lens)
        assert listed.positions.max() <= cache.max_len - 1
        assert listed.write_slots.tolist() == [[s] * n + [cache.scratch_slot] * (width - n) for s, n in zip(slots, q_lens)]
