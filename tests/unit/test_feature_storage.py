"""FP8 storage of captured hidden states (train.feature_storage): its rounding, its scales, its bytes."""

from __future__ import annotations

import pytest
import torch

from draftsmith.train.capture import bytes_needed
from draftsmith.train.feature_storage import FP8, SCALE_SUFFIX, compute_dtype, decode, encode, round_trip

E4M3_STEP = 2.0**-3  # 3 mantissa bits: a normal value rounds within half a step, 1/16 of itself


def hidden_states(tokens: int, layers: int, hidden: int, seed: int = 0) -> torch.Tensor:
    """Hidden-state-like values: each layer its own scale, a few outlier channels 100x the rest."""
    g = torch.Generator().manual_seed(seed)
    values = torch.randn(tokens, layers, hidden, generator=g)
    values *= torch.logspace(-1, 1, layers)[None, :, None]
    values[:, :, :3] *= 100
    return values.flatten(1)


def test_fp8_rounds_each_value_within_its_layers_step():
    layers, hidden = 3, 64
    values = hidden_states(50, layers, hidden)
    stored = encode(values, layers, "fp8")
    assert stored[""].dtype == FP8 and stored[SCALE_SUFFIX].shape == (50, layers)
    back = decode(stored[""], stored[SCALE_SUFFIX], torch.float32)
    grouped, back_grouped = values.unflatten(1, (layers, hidden)), back.unflatten(1, (layers, hidden))
    amax = grouped.abs().amax(-1, keepdim=True)
    # normal values: relative error under half a step; the smallest, at most E4M3's subnormal spacing
    bound = torch.maximum(grouped.abs() * E4M3_STEP / 2, amax / 448 * 2.0**-9)
    assert ((grouped - back_grouped).abs() <= bound * 1.0001).all()
    # each layer's largest value maps to E4M3's largest and back, up to fp32 rounding of the scale
    torch.testing.assert_close(back_grouped.abs().amax(-1, keepdim=True), amax, rtol=1e-6, atol=0)


def test_a_scale_per_layer_keeps_a_quiet_layer_that_one_per_token_would_flush():
    quiet, loud = torch.randn(20, 64) * 1e-3, torch.randn(20, 64) * 1e3
    values = torch.cat([quiet, loud], dim=1)
    per_layer = round_trip(values, 2, "fp8").float()[:, :64]
    per_token = round_trip(values, 1, "fp8").float()[:, :64]  # one scale over both layers, as speculators'
    assert ((per_layer - quiet).abs() / quiet.abs()).median() < E4M3_STEP / 2
    assert (per_token == 0).float().mean() > 0.9  # the quiet layer sinks under E4M3's smallest subnormal


def test_rows_of_zeros_and_float_storages_round_trip():
    values = torch.zeros(4, 128)
    values[1] = torch.randn(128)
    back = round_trip(values, 2, "fp8")
    assert torch.isfinite(back).all() and torch.equal(back[0], values[0]) and back.dtype == torch.bfloat16
    assert torch.equal(round_trip(values, 2, "bfloat16"), values.to(torch.bfloat16))
    assert torch.equal(round_trip(values, 2, "float32"), values)
    assert encode(values, 2, "bfloat16").keys() == {""}


@pytest.mark.parametrize("storage, dtype", [("fp8", torch.bfloat16), ("bfloat16", torch.bfloat16),
                                            ("float32", torch.float32)])
def test_training_computes_in(storage, dtype):
    assert compute_dtype(storage) == dtype


def test_fp8_takes_about_half_of_bf16s_bytes():
    # an 8B target's EAGLE-3 capture: three feature layers and the last, 4096 wide
    bf16 = bytes_needed(1000, 3, 4096, True, "bfloat16")
    fp8 = bytes_needed(1000, 3, 4096, True, "fp8")
    assert bf16 == 1000 * (4 * 4096 * 2 + 5)
    assert fp8 == 1000 * (4 * 4096 + 4 * 4 + 5)
    assert 0.5 < fp8 / bf16 < 0.501
