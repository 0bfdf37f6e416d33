"""models/linear.py: the oneDNN inference path (and MKL's, for small weights where its rows agree) computes what
nn.Linear does, row by row the same at any batch size, and follows weight updates; training keeps aten's linear
and its gradients. These forms run bf16 layers, and fp32 ones where the panel GEMM does not
(tests/unit/test_panel_linear_cpu.py), so the panel form is kept off here."""

import copy
import io

import pytest
import torch
import torch.nn.functional as F

from draftsmith.models import linear as linear_module
from draftsmith.models.linear import Linear, fused, onednn_linear_available

# fp32: the same sums in another order; bf16: one rounding of the output (8 bits of mantissa)
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
needs_onednn = pytest.mark.skipif(not onednn_linear_available(torch.float32),
                                  reason="this torch build has no usable oneDNN linear: Linear runs aten's")


@pytest.fixture(autouse=True)
def without_panels(monkeypatch):
    monkeypatch.setattr(linear_module, "_takes_panels", lambda layers: False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [True, False])
def test_matches_aten_linear(dtype, bias):
    layer = Linear(96, 40, bias=bias).to(dtype)
    x = torch.randn(3, 11, 96).to(dtype)
    for batch in (x, x[:, ::2], x[0, :1]):  # 3-D, non-contiguous, one row
        with torch.inference_mode():
            got = layer(batch)
        torch.testing.assert_close(got.float(), F.linear(batch, layer.weight, layer.bias).float(),
                                   atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@needs_onednn
def test_rows_do_not_depend_on_batch_size():
    layer = Linear(512, 1536)
    x = torch.randn(40, 512)
    with torch.inference_mode():
        whole = layer(x)
        assert "_onednn_weight" in layer.__dict__  # the fast path ran
        for rows in (1, 2, 5, 8, 33):
            assert torch.equal(layer(x[:rows]), whole[:rows])


@needs_onednn
def test_follows_weight_updates():
    layer = Linear(32, 16)
    x = torch.randn(4, 32)
    with torch.no_grad():
        before = layer(x)
        snapshot = copy.deepcopy(layer.state_dict())
        layer.weight.mul_(2)  # in place: the reordered copy must be rebuilt
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))
        layer.load_state_dict(snapshot)
        torch.testing.assert_close(layer(x), before)



@needs_onednn
def test_follows_replaced_weights_and_thread_counts():
    """The cached plan is checked on every call: a parameter replaced, a `.data` swapped or a fused group's
    bias changed in place all show, and so does a new thread count (MKL's batch invariance depends on it)."""
    layer, other = Linear(32, 16), Linear(32, 8)
    x = torch.randn(3, 32)
    with torch.no_grad():
        layer(x), fused((layer, other), x)
        layer.weight = torch.nn.Parameter(torch.randn(16, 32))
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))
        layer.weight.data = torch.randn(16, 32)
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))
        other.bias.add_(1.0)
        torch.testing.assert_close(fused((layer, other), x)[1], F.linear(x, other.weight, other.bias))
        threads = torch.get_num_threads()
        plan = layer.__dict__["_plan"]
        try:
            torch.set_num_threads(threads + 1)
            layer(x)
            assert layer.__dict__["_plan"] is not plan and layer.__dict__["_plan"].threads == threads + 1
        finally:
            torch.set_num_threads(threads)


def test_a_weight_moved_out_of_the_parameters_takes_atens_path():
    """A wrapper may hold a layer's weight as a plain attribute (FSDP's flat parameters): the layer and a fused
    group with it compute aten's linear of that weight, not a cached copy of the one it replaced."""
    layer, other = Linear(32, 16), Linear(32, 8)
    x = torch.randn(3, 32)
    with torch.inference_mode():
        layer(x), fused((layer, other), x)
    moved = torch.randn(16, 32)
    del layer._parameters["weight"]
    layer.weight = moved
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), F.linear(x, moved, layer.bias))
        torch.testing.assert_close(fused((layer, other), x)[0], F.linear(x, moved, layer.bias))


def test_a_pruned_bias_takes_atens_path():
    """Pruning keeps a layer's bias as a plain attribute (the mask applied to `bias_orig`): both the layer and a
    fused group with it compute with the pruned bias."""
    from torch.nn.utils import prune

    layer, other = Linear(32, 16), Linear(32, 8)
    x = torch.randn(3, 32)
    with torch.inference_mode():
        layer(x), fused((layer, other), x)
    prune.l1_unstructured(layer, "bias", amount=0.5)
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))
        torch.testing.assert_close(fused((layer, other), x)[0], F.linear(x, layer.weight, layer.bias))


@needs_onednn
def test_follows_data_swapped_again_and_again():
    """A plan keeps the storage it was built from alive, so a later `.data` cannot reuse its address unseen."""
    layer = Linear(64, 64)
    x = torch.randn(2, 64)
    with torch.no_grad():
        for _ in range(16):  # two swaps between calls: the first's storage is free by the second
            layer.weight.data = torch.randn(64, 64)
            layer.weight.data = torch.randn(64, 64)
            torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), atol=1e-4, rtol=1e-4)

def test_training_uses_aten_with_the_same_gradients():
    layer = Linear(24, 8)
    reference = torch.nn.Linear(24, 8)
    reference.load_state_dict(layer.state_dict())
    x = torch.randn(5, 24)
    layer(x).square().sum().backward()
    reference(x).square().sum().backward()
    assert "_onednn_weight" not in layer.__dict__
    torch.testing.assert_close(layer.weight.grad, reference.weight.grad)
    torch.testing.assert_close(layer.bias.grad, reference.bias.grad)


def test_copies_and_pickles_after_use():
    layer = Linear(16, 8)
    x = torch.randn(2, 16)
    with torch.inference_mode():
        expected = layer(x)
    copied = copy.deepcopy(layer)
    buffer = io.BytesIO()
    torch.save(layer, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    with torch.inference_mode():
        torch.testing.assert_close(copied(x), expected)
        torch.testing.assert_close(loaded(x), expected)


def test_environment_turns_it_off(monkeypatch):
    monkeypatch.setenv("DRAFTSMITH_CPU_LINEAR", "aten")
    monkeypatch.setattr(linear_module, "_usable", {})
    layer = Linear(16, 8)
    with torch.inference_mode():
        layer(torch.randn(2, 16))
    assert not onednn_linear_available(torch.float32)
    assert "_onednn_weight" not in layer.__dict__


def test_a_first_call_under_autocast_keeps_the_fast_path(monkeypatch):
    """The build check compares oneDNN with aten in the dtype asked: autocast around the first call (a
    training step's frozen target) must not make aten's bf16 result the reference for fp32."""
    monkeypatch.setattr(linear_module, "_usable", {})
    with torch.autocast("cpu", dtype=torch.bfloat16):
        in_autocast = onednn_linear_available(torch.float32)
    monkeypatch.setattr(linear_module, "_usable", {})
    assert in_autocast == onednn_linear_available(torch.float32)


def test_autocast_regions_compute_as_aten_does():
    """Under autocast a layer computes in the autocast dtype, as nn.Linear does, not on the fp32 fast path."""
    layer = Linear(64, 32)
    x = torch.randn(3, 64)
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        got, expected = layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, expected)


def test_row_buckets_bound_the_shapes_compiled():
    """oneDNN compiles a kernel per row count: rows above EXACT_ROWS are padded to buckets, a few per octave
    and at most an eighth more rows, and the padded call returns exactly the unpadded rows' results."""
    buckets = {linear_module.row_bucket(rows) for rows in range(1, 4097)}
    assert len(buckets) <= 70
    for rows in range(1, 4097):
        bucket = linear_module.row_bucket(rows)
        assert rows <= bucket <= max(rows + linear_module.MIN_STEP - 1, rows * 9 // 8 + 1)
        assert bucket == rows or rows > linear_module.EXACT_ROWS
    layer = Linear(64, 24)
    x = torch.randn(2, 37, 64)  # 74 rows -> 80
    with torch.inference_mode():
        got = layer(x)
    assert got.shape == (2, 37, 24)
    torch.testing.assert_close(got, F.linear(x, layer.weight, layer.bias), atol=1e-5, rtol=1e-5)
    if onednn_linear_available(torch.float32):
        with torch.inference_mode():
            assert all(torch.equal(layer(x[0, :n]), got[0, :n]) for n in (9, 17, 30))


def test_warm_up_runs_each_shape_once_per_bucket():
    """The engine compiles its decode/verify kernels at start: one call per row bucket for each distinct
    (in, out, dtype, bias), shared across modules (kernels are per shape), and the layers are left as they were."""
    first = torch.nn.Sequential(Linear(32, 16), Linear(16, 32), Linear(32, 16))  # the third repeats the first
    second = torch.nn.Sequential(Linear(16, 32), Linear(16, 32, bias=False))  # one shape new
    before = [p.clone() for p in first.parameters()]
    buckets = len({linear_module.row_bucket(rows) for rows in range(1, 41)})  # 1..16, 24, 32, 40
    calls = linear_module.warm_up([first, second], 40)
    expected = 3 * buckets if onednn_linear_available(torch.float32) else 0
    assert buckets == 19 and calls == expected
    assert all(torch.equal(a, b) for a, b in zip(before, first.parameters()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [True, False])
def test_fused_layers_compute_each_layer(dtype, bias):
    """q/k/v (or gate/up) in one call on stacked weights: each output is its layer's, for 1-row and padded
    batches, and follows a weight update; with autograd on, each layer runs on its own (gradients flow)."""
    layers = tuple(Linear(64, out, bias=bias).to(dtype) for out in (48, 16, 16))
    x = torch.randn(2, 7, 64).to(dtype)
    for batch in (x, x[0, :1], x.reshape(14, 64)):
        with torch.inference_mode():
            outputs = fused(layers, batch)
        assert [o.shape[-1] for o in outputs] == [48, 16, 16]
        for layer, out in zip(layers, outputs):
            torch.testing.assert_close(out.float(), F.linear(batch, layer.weight, layer.bias).float(),
                                       atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    if onednn_linear_available(dtype):  # the fused path ran, in one of its two forms
        assert {"_onednn_fused", "_mm_fused"} & set(layers[0].__dict__)
    updates = [lambda: layers[1].weight.mul_(2)] + ([lambda: layers[2].bias.add_(1)] if bias else [])
    for update in updates:  # a weight changing rebuilds the stacked copy, and so does a bias alone
        with torch.no_grad():
            update()
        with torch.inference_mode():
            outputs = fused(layers, x)
        for layer, out in zip(layers, outputs):
            torch.testing.assert_close(out.float(), F.linear(x, layer.weight, layer.bias).float(),
                                       atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    if dtype == torch.float32:
        fused(layers, x)[2].sum().backward()
        assert layers[2].weight.grad is not None and layers[0].weight.grad is None


def test_warm_up_covers_fused_groups():
    """A module's fused groups (`fused_linears`) are shapes of their own: warmed once per bucket too."""
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = Linear(32, 16), Linear(32, 8)

        def fused_linears(self):
            return ((self.a, self.b),)

    buckets = len({linear_module.row_bucket(rows) for rows in range(1, 41)})
    calls = linear_module.warm_up([Block(), Block()], 40)  # a, b and (a, b): three shapes, twice each
    assert calls == (3 * buckets if onednn_linear_available(torch.float32) else 0)


@needs_onednn
def test_small_weights_take_mm_where_every_row_count_agrees():
    """A small fp32 weight runs MKL's GEMM on a transposed copy once the check finds its rows equal at every
    row count: one row (run as two) and any batch then give each row the same result."""
    layer = Linear(256, 192)
    x = torch.randn(40, 256)
    with torch.inference_mode():
        whole = layer(x)
        assert all(torch.equal(layer(x[:rows]), whole[:rows]) for rows in (1, 2, 5, 8, 33))
    torch.testing.assert_close(whole, F.linear(x, layer.weight, layer.bias), atol=1e-5, rtol=1e-5)
    key = (192, 256, True, torch.get_num_threads())
    assert ("_mm_weight" in layer.__dict__) == linear_module._mm_agrees[key]
    assert ("_onednn_weight" in layer.__dict__) != linear_module._mm_agrees[key]


@needs_onednn
def test_rows_that_disagree_keep_onednn(monkeypatch):
    """MKL summing a row differently at another row count (as 512 x 1536 does at two threads from 17 rows),
    the weight stays on oneDNN; so does every weight with DRAFTSMITH_CPU_LINEAR=onednn."""
    real_mm = linear_module._mm
    monkeypatch.setattr(linear_module, "_mm_agrees", {})
    monkeypatch.setattr(linear_module, "_mm", lambda x, t, b: real_mm(x, t, b) + (len(x) > 16) * 1e-3)
    layer = Linear(64, 32)
    with torch.inference_mode():
        layer(torch.randn(3, 64))
    assert "_onednn_weight" in layer.__dict__ and "_mm_weight" not in layer.__dict__

    monkeypatch.setattr(linear_module, "_mm", real_mm)
    monkeypatch.setattr(linear_module, "_mm_agrees", {})
    monkeypatch.setenv("DRAFTSMITH_CPU_LINEAR", "onednn")
    layer = Linear(64, 32)
    with torch.inference_mode():
        layer(torch.randn(3, 64))
    assert "_onednn_weight" in layer.__dict__ and "_mm_weight" not in layer.__dict__


@needs_onednn
@pytest.mark.parametrize("bias", [True, False])
def test_mkl_path_computes_the_linear_for_one_row_batches_and_more_rows_than_checked(monkeypatch, bias):
    """On MKL's path (forced here, whatever this machine's check says): one row (run as two), 3-D and
    non-contiguous inputs, and a call of more rows than the check covered (run in pieces) all compute the
    linear; where the check passes, each row equals itself at any batch size."""
    monkeypatch.setattr(linear_module, "MM_CHECKED_ROWS", 8)
    monkeypatch.setattr(linear_module, "_takes_mm", lambda *args: True)
    layer = Linear(64, 32, bias=bias)
    x = torch.randn(3, 7, 64)
    with torch.inference_mode():
        for batch in (x, x[:, ::2], x[0, :1], x.reshape(21, 64), x.reshape(21, 64)[:9]):
            torch.testing.assert_close(layer(batch), F.linear(batch, layer.weight, layer.bias), atol=1e-5, rtol=1e-5)
        assert "_mm_weight" in layer.__dict__ and "_onednn_weight" not in layer.__dict__
        if linear_module._mm_rows_agree(32, 64, bias):  # rows 2..8 checked: pieces of 6, then 3
            whole = layer(x.reshape(21, 64))
            assert all(torch.equal(layer(x.reshape(21, 64)[:n]), whole[:n]) for n in (1, 2, 6, 8, 15))


def _traced_graphs(fn, *args):
    """fn(*args) under torch.compile with a backend that keeps Dynamo's graphs and runs them as traced."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    out = torch.compile(fn, fullgraph=True, backend=backend)(*args)
    return out, graphs


def _calls(graphs) -> set:
    return {str(node.target) for gm in graphs for node in gm.graph.nodes if node.op == "call_function"}


@needs_onednn
def test_a_traced_layer_runs_the_plan_its_eager_calls_made():
    """Traced by torch.compile (a compiled engine step), a layer and a fused group call oneDNN's linear on the
    weight their eager calls reordered, as eager calls do: the same result to the bit, each row as it would be
    alone. A layer never called eagerly has no plan and traces as aten's linear."""
    torch.manual_seed(0)
    layer, group = Linear(64, 48), (Linear(64, 32, bias=False), Linear(64, 16, bias=False))
    x = torch.randn(5, 64)
    with torch.inference_mode():
        assert "linear" in " ".join(_calls(_traced_graphs(layer, x)[1]))  # no plan yet: aten's
        eager_one, eager_group = layer(x), fused(group, x)
        traced_one, graphs = _traced_graphs(layer, x)
        assert "mkldnn._linear_pointwise.default" in _calls(graphs)
        assert torch.equal(traced_one, eager_one)
        traced_group, graphs = _traced_graphs(lambda t: fused(group, t), x)
        assert _calls(graphs) & {"mkldnn._linear_pointwise.default"}
        assert all(torch.equal(a, b) for a, b in zip(traced_group, eager_group))
        alone = _traced_graphs(layer, x[2:3])[0]
    assert torch.equal(alone, eager_one[2:3])


@needs_onednn
def test_plans_made_ahead_cover_every_layer_once():
    """`make_plans` (run before a compiled step is first traced): every fused group gets its plan and every
    layer outside a group its own, the grouped layers none of their own (a second reordered copy of each
    weight); traced afterwards, the module calls no aten linear."""
    from draftsmith.models.config import TargetConfig
    from draftsmith.models.llama import MLP

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.mlp = MLP(TargetConfig("llama", 64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=2, head_dim=16))
            self.out = Linear(32, 16)

        def forward(self, x):
            return self.out(self.mlp(x))

    torch.manual_seed(0)
    block = Block()
    assert linear_module.make_plans([block]) == 3  # gate/up, down, out
    gate, up, down = block.mlp.gate_proj, block.mlp.up_proj, block.mlp.down_proj
    assert "_fused_plan" in gate.__dict__ and "_plan" not in gate.__dict__ and "_plan" not in up.__dict__
    assert "_plan" in down.__dict__ and "_plan" in block.out.__dict__
    with torch.inference_mode():
        x = torch.randn(3, 32)
        _, graphs = _traced_graphs(block, x)
    assert not {c for c in _calls(graphs) if "linear" in c or c.endswith(".mm")} - {"mkldnn._linear_pointwise.default"}
