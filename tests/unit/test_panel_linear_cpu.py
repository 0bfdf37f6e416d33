"""The panel GEMM (models/panel_linear_cpu.cpp) that fp32 `Linear` layers run on an AVX-512 CPU: it computes
F.linear (to fp32 rounding: its own order of sums), each row bit for bit the same at every row count and in
either tile (a verify computes a row as a decode does), a fused group's columns as each layer's alone; and
`Linear` takes it only where it applies (fp32, the build loaded, not turned off)."""

import pytest
import torch
import torch.nn.functional as F

from draftsmith.models import linear as linear_module
from draftsmith.models import slot_attention_cpu
from draftsmith.models.linear import Linear, fused, pack_weights_in
from helpers import panel_gemm_missing

WHY_NOT = panel_gemm_missing("fp32 linear layers stay on oneDNN")
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=str(WHY_NOT))


def _panel(x, weight, bias=None):
    packed = torch.ops.draftsmith_cpu.pack_panels(weight)
    return torch.ops.draftsmith_cpu.panel_linear(x, packed, bias, weight.shape[0])


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("in_features, out_features", [(512, 768), (256, 8192), (1536, 512), (100, 45), (7, 33)])
def test_computes_the_linear(in_features, out_features, bias):
    generator = torch.Generator().manual_seed(in_features + out_features)
    weight = torch.randn(out_features, in_features, generator=generator)
    offsets = torch.randn(out_features, generator=generator) if bias else None
    x = torch.randn(2, 37, in_features, generator=generator)
    for batch in (x, x[:, ::3], x[0, :1], x[0, :8], x[:, :0]):  # 3-D, not contiguous, few rows, none
        got = _panel(batch, weight, offsets)
        assert got.shape == (*batch.shape[:-1], out_features)
        exact = F.linear(batch.double(), weight.double(), None if offsets is None else offsets.double())
        # a chain of K + 1 fp32 roundings: within (K + 1) u of the sum of the terms' magnitudes
        terms = F.linear(batch.double().abs(), weight.double().abs())
        if offsets is not None:
            terms = terms + offsets.double().abs()
        assert ((got.double() - exact).abs() <= (in_features + 1) * 2.0**-24 * terms).all()


def test_each_row_is_the_same_at_every_row_count():
    """Row counts up to 8 run 8 x 32 tiles, more run 6 x 64 ones with row tails of 1-5: a row's result is one
    chain of multiply-adds either way."""
    generator = torch.Generator().manual_seed(0)
    weight, offsets = torch.randn(200, 96, generator=generator), torch.randn(200, generator=generator)
    x = torch.randn(150, 96, generator=generator)
    whole = _panel(x, weight, offsets)
    for rows in [*range(1, 20), 40, 72, 149]:
        assert torch.equal(_panel(x[:rows], weight, offsets), whole[:rows]), rows
    assert torch.equal(_panel(x[100:101], weight, offsets)[0], whole[100])


@pytest.mark.parametrize("in_features, out_features", [(256, 4096), (100, 45), (7, 33)])
def test_bfloat16_panels_compute_over_the_rounded_weights(in_features, out_features):
    """Panels packed from a bfloat16 weight give, bit for bit, what fp32 panels of the same values give: each
    weight is widened exactly and the sums are the fp32 chain; at every row count, in either tile."""
    generator = torch.Generator().manual_seed(out_features)
    weight = torch.randn(out_features, in_features, generator=generator).bfloat16()
    offsets = torch.randn(out_features, generator=generator)
    x = torch.randn(40, in_features, generator=generator)
    half = torch.ops.draftsmith_cpu.pack_panels(weight)
    assert half.dtype == torch.bfloat16
    whole = torch.ops.draftsmith_cpu.panel_linear(x, half, offsets, out_features)
    assert torch.equal(whole, _panel(x, weight.float(), offsets))
    for rows in (1, 3, 8, 9, 13):
        assert torch.equal(torch.ops.draftsmith_cpu.panel_linear(x[:rows], half, offsets, out_features), whole[:rows])


def test_bfloat16_panels_store_each_row_interleaved():
    """A bfloat16 panel row holds columns 0, 16, 1, 17, ..., 15, 31 (so a shift and a mask widen it); fp32
    panels hold them in order."""
    weight = torch.arange(64 * 3, dtype=torch.float32).view(64, 3)
    half = torch.ops.draftsmith_cpu.pack_panels(weight.bfloat16())
    columns = torch.stack([torch.arange(16), torch.arange(16, 32)], dim=1).flatten()
    for p in range(2):
        assert torch.equal(half[p].float(), weight[p * 32 + columns].t())
        assert torch.equal(torch.ops.draftsmith_cpu.pack_panels(weight)[p], weight[p * 32:(p + 1) * 32].t())


def test_fp32_weights_of_bfloat16_values_are_packed_in_bfloat16_exactly():
    """A target loaded in fp32 from a bfloat16 checkpoint: its layers read half the bytes and compute, bit for
    bit, what fp32 panels of the same weight compute. A weight with one value off the bfloat16 grid stays
    fp32, and so does every layer when the packed copy would not be exact."""
    generator = torch.Generator().manual_seed(3)
    stored = Linear(96, 70)
    with torch.no_grad():
        stored.weight.copy_(torch.randn(70, 96, generator=generator).bfloat16().float())
    off_grid = Linear(96, 70)
    with torch.no_grad():
        off_grid.weight.copy_(stored.weight)
        off_grid.weight[5, 7] += 2.0**-20  # below a bfloat16 step of a value near 1
    x = torch.randn(11, 96, generator=generator)
    with torch.inference_mode():
        for rows in (1, 4, 8, 11):
            assert torch.equal(stored(x[:rows]), _panel(x[:rows], stored.weight.detach(), stored.bias.detach()))
        off_grid(x)
    assert stored.__dict__["_plan"].weight.dtype == torch.bfloat16
    assert off_grid.__dict__["_plan"].weight.dtype == torch.float32


def test_packing_a_drafters_layers_leaves_what_it_shares_with_the_target():
    """`pack_weights_in` packs a drafter's own fp32 layers in bfloat16, never a layer whose weight is the
    target's (an LM head both read), and a packed fused group still splits into its layers' columns."""
    target = torch.nn.ModuleDict({"lm_head": Linear(64, 96, bias=False)})
    drafter = torch.nn.ModuleDict({"q": Linear(64, 32), "k": Linear(64, 16), "readout": Linear(64, 96, bias=False)})
    drafter["readout"].weight = target["lm_head"].weight
    x = torch.randn(3, 64)
    with torch.inference_mode():
        before = drafter["q"](x)
        assert pack_weights_in([drafter], torch.bfloat16, shared=target) == 2
        got = drafter["q"](x)
        q, k = fused((drafter["q"], drafter["k"]), x)
        k_alone = drafter["k"](x)
        shared = drafter["readout"](x)
    assert drafter["q"].__dict__["_plan"].weight.dtype == torch.bfloat16
    assert drafter["readout"].__dict__["_plan"].weight.dtype == torch.float32
    assert torch.equal(shared, _panel(x, target["lm_head"].weight.detach()))
    assert torch.equal(got, _panel(x, drafter["q"].weight.detach().bfloat16(), drafter["q"].bias.detach()))
    assert not torch.equal(got, before)  # the weights were rounded: packed anew, not the fp32 plan kept
    assert torch.equal(q, got) and torch.equal(k, k_alone)


def test_a_fused_group_computes_each_layer_bit_for_bit():
    """Stacked weights (q/k/v, gate/up) give each layer's columns exactly as the layer alone: a column's chain
    does not depend on its neighbours."""
    layers = tuple(Linear(64, size) for size in (64, 16, 16))
    x = torch.randn(5, 3, 64)
    with torch.inference_mode():
        together = fused(layers, x)
        assert layers[0].__dict__["_fused_plan"].form == "panel"
        for layer, part in zip(layers, together):
            assert torch.equal(part, layer(x))


def test_linear_takes_it_for_fp32_only_and_where_asked(monkeypatch):
    x = torch.randn(4, 64)
    layer = Linear(64, 40)
    with torch.inference_mode():
        got = layer(x)
    assert layer.__dict__["_plan"].form == "panel" and "_panel_weight" in layer.__dict__
    torch.testing.assert_close(got, F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
    half = Linear(64, 40).bfloat16()
    with torch.inference_mode():
        half(x.bfloat16())
    assert half.__dict__["_plan"].form != "panel"
    monkeypatch.setenv("DRAFTSMITH_CPU_LINEAR", "onednn")
    with torch.inference_mode():
        Linear(64, 40)(x)  # a new layer's plan reads the variable
        kept = Linear(64, 40)
        kept(x)
    assert kept.__dict__["_plan"].form == "onednn"


def test_a_plan_made_before_the_build_loaded_moves_to_panels(monkeypatch):
    """An engine loads the build before its layers' plans are made; a plan made earlier in the process (the
    build not loaded yet) is made again once it is, so no layer stays on oneDNN by the order of events."""
    monkeypatch.setattr(slot_attention_cpu, "LOADED", False)
    layer = Linear(64, 40)
    x = torch.randn(3, 64)
    with torch.inference_mode():
        layer(x)
        assert layer.__dict__["_plan"].form != "panel"
        monkeypatch.setattr(slot_attention_cpu, "LOADED", True)
        layer(x)
    assert layer.__dict__["_plan"].form == "panel"


def test_a_compiled_function_calls_it():
    """A compiled step traces the op (its shape from the fake kernel) and computes what eager calls do."""
    layer = Linear(64, 40)
    x = torch.randn(8, 64)
    with torch.inference_mode():
        eager = layer(x)
        compiled = torch.compile(lambda t: layer(t), backend="eager", fullgraph=True)(x)
    assert torch.equal(compiled, eager)


def test_bad_calls_say_what_is_wrong():
    packed = torch.ops.draftsmith_cpu.pack_panels(torch.randn(40, 16))
    with pytest.raises(RuntimeError, match="in_features"):
        torch.ops.draftsmith_cpu.panel_linear(torch.randn(2, 15), packed, None, 40)
    with pytest.raises(RuntimeError, match="does not fit the panels"):
        torch.ops.draftsmith_cpu.panel_linear(torch.randn(2, 16), packed, None, 80)
    with pytest.raises(RuntimeError, match="fp32"):
        torch.ops.draftsmith_cpu.panel_linear(torch.randn(2, 16).double(), packed, None, 40)
    assert linear_module._panels_built()
