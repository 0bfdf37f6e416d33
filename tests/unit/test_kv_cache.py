"""Per-slot cache mechanics: padding never touches live slots, rewinding drops tokens without copies."""

import torch

from draftsmith.models import ForwardBatch, load_target
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
