"""Sampling: filters match a brute-force reference, draws follow the filtered distribution, seeds repeat."""

import pytest
import torch

from draftsmith.errors import DraftsmithError
from draftsmith.serve.engine.sampling import SamplingBatch, logits_to_probs, sample
from draftsmith.serve.engine.sampling_params import SamplingParams


def _batch(params, seeds=None):
    generators = [torch.Generator().manual_seed(s) for s in (seeds or range(len(params)))]
    return SamplingBatch.build(params, generators, "cpu")


def _reference_probs(logits, temperature, top_k, top_p):
    probs = torch.softmax(logits / temperature, -1)
    order = probs.argsort(descending=True)
    keep = torch.zeros_like(probs, dtype=torch.bool)
    mass = 0.0
    for rank, token in enumerate(order.tolist()):
        if (top_k > 0 and rank >= top_k) or (rank > 0 and mass >= top_p):
            break
        keep[token] = True
        mass += probs[token].item()
    filtered = torch.where(keep, probs, torch.zeros_like(probs))
    return filtered / filtered.sum()


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, -1, 1.0), (0.7, 5, 1.0), (1.3, -1, 0.8), (0.5, 20, 0.6)])
def test_filters_match_reference(temperature, top_k, top_p):
    logits = torch.randn(3, 50) * 3
    params = [SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)] * 3
    probs = logits_to_probs(logits[:, None], _batch(params))[:, 0]
    for row in range(3):
        torch.testing.assert_close(probs[row], _reference_probs(logits[row], temperature, top_k, top_p),
                                   atol=1e-6, rtol=1e-5)


@pytest.mark.slow
def test_draws_follow_the_filtered_distribution():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    params = SamplingParams(temperature=0.9, top_k=4)
    expected = _reference_probs(logits, 0.9, 4, 1.0)
    batch = _batch([params], seeds=[123])
    draws = torch.stack([sample(logits[None], batch) for _ in range(20000)]).flatten()
    freq = torch.bincount(draws, minlength=6).float() / draws.numel()
    assert freq[4:].sum() == 0  # outside top-k never drawn
    assert (freq - expected).abs().max() < 0.015  # ~4 sigma at 20k draws


def test_greedy_rows_take_argmax_and_seeds_repeat():
    logits = torch.randn(3, 100)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0, seed=5),
              SamplingParams(temperature=1.0, seed=5)]
    first = sample(logits, _batch(params, seeds=[0, 5, 5]))
    again = sample(logits, _batch(params, seeds=[9, 5, 5]))
    assert first[0] == logits[0].argmax()
    assert torch.equal(first, again)
    many = torch.stack([sample(logits, _batch(params, seeds=[0, s, s])) for s in range(30)])
    assert len(set(many[:, 1].tolist())) > 1  # different seeds, different draws


@pytest.mark.parametrize("field,value", [("temperature", -0.1), ("top_p", 0.0), ("top_k", -2), ("max_tokens", 0), ("n", 0)])
def test_invalid_params_name_the_field(field, value):
    with pytest.raises(DraftsmithError, match=field):
        SamplingParams(**{field: value})


def test_a_verify_row_without_drafts_draws_its_token_as_a_plain_step():
    """In a verify step, a sampled row that drafted nothing (at its max_tokens while others draft) must draw
    the token a plain step would, and leave its own stream alone: alone, that step is plain, and a seeded
    request samples the same tokens batched or alone (this broke with the retrained demo head)."""
    from draftsmith.serve.engine.sampling import verify_noise

    params = [SamplingParams(temperature=0.8, seed=1), SamplingParams(temperature=0.8, seed=2)]
    logits = torch.randn(2, 64, generator=torch.Generator().manual_seed(0))

    def batch():
        generators = [torch.Generator().manual_seed(7), torch.Generator().manual_seed(8)]
        return SamplingBatch.build(params, generators, "cpu", seeds=[1, 2], positions=[30, 40])

    plain, verifying = batch(), batch()
    noise = verify_noise(verifying, [3, 0], 64, "cpu")
    probs = logits_to_probs(logits[:, None], plain)[:, 0]
    assert (probs[1] / noise[1]).argmax() == sample(logits, plain)[1]  # row 1: the plain step's draw
    # row 1's own stream untouched, row 0's advanced by its draw
    assert torch.equal(verifying.generators[1].get_state(), torch.Generator().manual_seed(8).get_state())
    assert not torch.equal(verifying.generators[0].get_state(), torch.Generator().manual_seed(7).get_state())
