"""The C++ prompt attention kernel against its PyTorch reference (SDPA per chunk): GQA groups of 1 to 4, head_dim
64 and 128, chunks from position 0 and later ones, lengths off every block size, several chunks in scattered
slots in one call; and the model's prefill paths (padded and packed) that call it agree with SDPA's."""

import pytest
import torch

import draftsmith.models.prompt_attention as prompt_module
from draftsmith.models import ForwardBatch, load_target
from draftsmith.models.prompt_attention import kernel_applies, prompt_attention, prompt_attention_reference
from draftsmith.models.slot_attention_cpu import build_error
from helpers import DEMO_MODEL

pytestmark = pytest.mark.skipif(build_error() is not None, reason=f"the CPU kernel did not build: {build_error()}")


def _case(heads, kv_heads, dim, spans, seed=0, slots=5, max_len=800):
    generator = torch.Generator().manual_seed(seed)
    tokens = max(first + n for _, _, n, first in spans)
    k_cache = torch.randn(slots, kv_heads, max_len, dim, generator=generator)
    v_cache = torch.randn(slots, kv_heads, max_len, dim, generator=generator)
    # as the model's projection leaves it: [T, H, D] a view of [T, H * D]; large scores test the max's merges
    q = 4 * torch.randn(tokens, heads * dim, generator=generator).view(tokens, heads, dim)
    return q, k_cache, v_cache


@pytest.mark.parametrize("heads,kv_heads,dim", [(8, 2, 64), (4, 4, 64), (6, 2, 128), (4, 1, 64)])
@pytest.mark.parametrize("length", [1, 3, 31, 33, 64, 65, 130, 555])
def test_one_prompt_from_position_0_matches_the_reference(heads, kv_heads, dim, length):
    spans = [(3, 0, length, 0)]
    q, k, v = _case(heads, kv_heads, dim, spans)
    assert kernel_applies(q)
    torch.testing.assert_close(prompt_attention(q, k, v, spans), prompt_attention_reference(q, k, v, spans),
                               atol=2e-5, rtol=2e-5)


def test_chunks_in_scattered_slots_and_later_chunks_match_the_reference():
    # (slot, start, count, first token): a first chunk, a chunk after 200 cached positions, a one-token chunk, a
    # chunk starting mid-block; tokens 700.. belong to no chunk and come back zero
    spans = [(4, 0, 300, 0), (1, 200, 97, 300), (0, 63, 1, 397), (2, 5, 250, 398)]
    q, k, v = _case(8, 2, 64, spans + [(0, 0, 20, 700)])
    got = prompt_attention(q, k, v, spans)
    torch.testing.assert_close(got, prompt_attention_reference(q, k, v, spans), atol=2e-5, rtol=2e-5)
    assert not got[648:].any()


def test_a_query_weighs_only_keys_up_to_its_own_position():
    # keys past the chunk's end hold huge values: any leak past a query's position would dominate its output
    spans = [(1, 0, 100, 0)]
    q, k, v = _case(4, 2, 64, spans)
    k[1, :, 100:] = 50.0
    v[1, :, 100:] = 1e6
    out = prompt_attention(q, k, v, spans)
    assert out.abs().max() < 100
    torch.testing.assert_close(out, prompt_attention_reference(q, k, v, spans), atol=2e-5, rtol=2e-5)


def test_shapes_the_kernel_does_not_take_run_the_reference():
    spans = [(0, 0, 40, 0)]
    q, k, v = _case(4, 2, 48, spans)  # head_dim 48: no kernel
    assert not kernel_applies(q)
    torch.testing.assert_close(prompt_attention(q, k, v, spans), prompt_attention_reference(q, k, v, spans))


@pytest.fixture(scope="module")
def demo_model():
    return load_target(DEMO_MODEL, dtype="float32")


@pytest.mark.parametrize("lengths", [[300, 300], [430, 120, 333]])
def test_the_models_prefill_agrees_with_and_without_the_kernel(lengths, demo_model, monkeypatch):
    """Equal lengths take the padded path, unequal ones the packed rows: both call the kernel."""
    model = demo_model
    generator = torch.Generator().manual_seed(len(lengths))
    ids = torch.randint(0, model.config.vocab_size, (len(lengths), max(lengths)), generator=generator)

    def prefill():
        cache = model.make_cache(len(lengths) + 1, 512)
        batch = ForwardBatch.build(list(range(len(lengths))), [0] * len(lengths), lengths, cache,
                                   model.config.sliding_window, pack=True)
        assert batch.causal and (batch.row_spans is not None) == (len(set(lengths)) > 1)
        with torch.inference_mode():
            out = model(ids, cache=cache, batch=batch, logits_index=torch.tensor(lengths)[:, None] - 1)
        return out.logits, cache.k[-1][: len(lengths)].clone()  # the last layer's keys: after attention

    assert kernel_applies(torch.zeros(1, 1, model.config.head_dim))
    logits, keys = prefill()
    monkeypatch.setattr(prompt_module, "cpu_attention_kernel_wanted", lambda: False)
    sdpa_logits, sdpa_keys = prefill()
    torch.testing.assert_close(logits, sdpa_logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(keys, sdpa_keys, atol=1e-4, rtol=1e-4)
