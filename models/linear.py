"""`Linear`: nn.Linear with a faster CPU inference path, oneDNN's GEMM on a weight reordered once.

On CPU, aten's linear (MKL sgemm) handles the few rows of decoding badly. On the 2-core dev VM, a 512 x 1536
fp32 projection takes 45 us for 1 row, 147 us for 4 to 8 rows (batched decode, or verifying a few drafts)
and 336 us for 32. oneDNN, with the weight reordered into its blocked layout ahead of time, takes 33-48 us
for 1-8 rows and 128 us for 32: whole target forwards run 1.4-2.3x faster. It is the op that torch.compile's
CPU freezing pass (Inductor's mkldnn fusion) emits for a linear layer; here it is called directly, and a
compiled engine step (`serve.engine.step_graphs`) calls it too, on the plan an eager call made
(`_traced_plan`).

It is also batch-invariant: each row's result does not depend on how many rows share the call (aten's is
not, past one row). A verify forward then computes a row exactly as a decode would, which keeps greedy
speculation token-for-token equal to plain decoding.

oneDNN compiles (JITs) a kernel for each new row count, about 0.35 ms per weight shape on the dev VM, ten
times a small call. Packed verifies and prompts bring a new row count at almost every step, so rows are
padded up to a few buckets (`row_bucket`): a bench level had spent 0.19 s in 340 such first calls. Padding
rows changes no row's result (batch invariance), and costs at most an eighth more rows.

The fast path applies on CPU without autograd (training keeps aten's linear and its gradients), for fp32,
and for bf16 where oneDNN supports it, with input and weight of one dtype. The reordered copy costs one
more copy of the weights in memory; it is rebuilt when the weight changes (in-place updates bump its
version, load_state_dict copies into it). `DRAFTSMITH_CPU_LINEAR=aten` turns the path off, for comparisons.

Small fp32 weights (up to MM_UP_TO_BYTES) take MKL's GEMM on a transposed copy instead (`torch.mm`): around
a small kernel, torch's oneDNN call costs more than the kernel, and MKL reads a small weight faster from
memory; from about 1.5 MB of weight on it is level or slower (measurements: docs/decisions/cpu-kernels.md).
MKL is batch-invariant only from two rows up (one row takes its GEMV path) and, with several threads, only
for some shapes: so a weight takes this path only once MKL computes every row alike at each row count of a
dense grid up to MM_CHECKED_ROWS (`_checked_rows`), checked once per shape, bias and thread count
(`_mm_rows_agree`); a one-row call runs as two, and a call of more rows runs in pieces of at most
MM_CHECKED_ROWS. `DRAFTSMITH_CPU_LINEAR=onednn` keeps every weight on oneDNN.

fp32 weights on a CPU with AVX-512, where the C++ build is loaded (`models.slot_attention_cpu`), take neither:
they are packed into column panels for a GEMM of our own (models/panel_linear_cpu.cpp), batch-invariant by
construction (each output one chain of multiply-adds over the input in order, whatever the row count), which
reads a weight at nearly the memory's pace at the few rows of decoding, where oneDNN reached about 60% of it,
and keeps level with oneDNN at prompt sizes (docs/decisions/cpu-kernels.md). `DRAFTSMITH_CPU_LINEAR=onednn`
keeps them on oneDNN too. A drafter's layers may be packed in bfloat16 (`pack_weights_in`): fp32 arithmetic
over weights that read half the bytes, for layers whose output is only a proposal. Any fp32 weight whose
values are all bfloat16 ones (a checkpoint stored in bfloat16) is packed in bfloat16 too: exactly, so its
results are the fp32 ones bit for bit, from half the bytes.

What a call runs is decided once per layer (and per fused group) and kept as its `_Plan`; a call only checks
that the plan still holds (the same tensors, versions and thread count). `DRAFTSMITH_CPU_LINEAR` is read when
a plan is made. Around one-row kernels of 15-30 us,
Python is a large share of a call: deciding again on every call had cost as much as the kernel itself.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Iterable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from draftsmith.models import slot_attention_cpu

logger = logging.getLogger("draftsmith")

REORDER_ROWS = 16  # the row count oneDNN lays the weight out for (any of 8-64 serves 1-128 rows alike)
# Row counts up to this run as they are (decode, a few drafts, a verify of up to 15 drafts, a DFlash block: the
# common shapes, compiled once each); above, they are padded up to a multiple of max(MIN_STEP, an eighth of
# the next power of two). Past 8 rows a GEMM costs in proportion to its rows, so padding must add few.
EXACT_ROWS = 16
MIN_STEP = 8
_usable: dict[torch.dtype, bool] = {}  # dtype -> whether the oneDNN path works in this torch build
MM_UP_TO_BYTES = 1 << 20  # fp32 weights up to this size take MKL's GEMM where it is batch-invariant
MM_CHECKED_ROWS = 4096  # row counts checked up to (prompt chunks included); larger calls run in pieces
# (out_features, in_features, bias, threads) -> whether MKL computes every row alike at every row count
_mm_agrees: dict[tuple[int, int, bool, int], bool] = {}


def onednn_linear_available(dtype: torch.dtype) -> bool:
    """Whether `Linear` takes the oneDNN path on CPU for this dtype: checked once against aten's result, so a
    build whose oneDNN lacks the op, or computes it wrongly, keeps aten's linear (logged once)."""
    usable = _usable.get(dtype)
    if usable is None:
        usable = _usable[dtype] = _check(dtype)
    return usable


def _check(dtype: torch.dtype) -> bool:
    if os.environ.get("DRAFTSMITH_CPU_LINEAR", "").lower() == "aten":
        return False
    if dtype not in (torch.float32, torch.bfloat16) or not torch.backends.mkldnn.is_available():
        return False
    ops = torch.ops.mkldnn
    if not (hasattr(ops, "_linear_pointwise") and hasattr(ops, "_reorder_linear_weight")):
        return False
    if dtype == torch.bfloat16 and not (hasattr(ops, "_is_mkldnn_bf16_supported") and ops._is_mkldnn_bf16_supported()):
        return False
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(24, 40, generator=generator).to(dtype)
    bias = torch.randn(24, generator=generator).to(dtype)
    x = torch.randn(3, 5, 40, generator=generator).to(dtype)
    # autocast off: the reference is aten's result in the dtype asked, wherever the first call comes from
    # (a training step's frozen target runs inside a bf16 autocast region)
    try:
        with torch.inference_mode(), torch.autocast("cpu", enabled=False):
            got = ops._linear_pointwise(x, ops._reorder_linear_weight(weight, REORDER_ROWS), bias, "none", [], "")
            expected = F.linear(x, weight, bias)
    except RuntimeError as exc:
        logger.info("oneDNN linear unavailable for %s (%s): using aten's", dtype, exc)
        return False
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    if got.shape != (3, 5, 24) or not torch.allclose(got.float(), expected.float(), rtol=tolerance, atol=tolerance):
        logger.warning("oneDNN linear disagrees with aten's for %s in this torch build: using aten's", dtype)
        return False
    return True


def row_bucket(rows: int) -> int:
    """The row count a call of `rows` rows runs at: 9 buckets an octave at most, so a server compiles a few
    dozen kernels per weight shape, not one per prompt length."""
    if rows <= EXACT_ROWS:
        return rows
    step = max(MIN_STEP, 1 << max((rows - 1).bit_length() - 4, 0))
    return -(-rows // step) * step


def warm_up(modules: Iterable[nn.Module], max_rows: int) -> int:
    """Compiles oneDNN's kernels for every row bucket up to `max_rows` and every distinct shape of the
    modules' `Linear` layers (and of their fused groups, `fused_linears`) now, not at the first step that
    needs each (a shape on MKL's path runs its batch-invariance check here instead): on a 2-core VM each
    costs about 0.35 ms, several a first forward at a new row count, and those first steps, timed slow, had
    taught the adaptive policy that verifying was dearer than it is.
    Kernels are per shape, not per weight, so one layer (or group) per shape is run. -> the calls run."""
    seen, calls = set(), 0
    buckets = sorted({row_bucket(rows) for rows in range(1, max_rows + 1)})
    for module in (sub for top in modules for sub in top.modules()):
        groups = [(module,)] if isinstance(module, Linear) else list(getattr(module, "fused_linears", tuple)())
        for group in groups:
            weight = group[0].weight
            if weight.device.type != "cpu" or not onednn_linear_available(weight.dtype):
                continue
            shape = (group[0].in_features, tuple(layer.out_features for layer in group), weight.dtype,
                     group[0].bias is not None)
            if shape in seen:
                continue
            seen.add(shape)
            with torch.inference_mode():
                for rows in buckets:
                    fused(group, torch.zeros(rows, group[0].in_features, dtype=weight.dtype))
                    calls += 1
    return calls


def pack_weights_in(modules: Iterable[nn.Module], dtype: torch.dtype, shared: nn.Module | None = None) -> int:
    """Packs the fp32 `Linear` layers of `modules` for the panel GEMM in `dtype` (bfloat16: each weight rounded
    once, half the bytes a call reads; inputs, sums and outputs stay fp32), all but those whose weight is one
    of `shared`'s parameters (a target's LM head that a head reads: the target must compute with it as it is).
    Only a drafter's layers are packed so: what they compute is a proposal that the target checks. Plans made
    before are dropped, to be made again. -> the layers packed so."""
    kept = {t.data_ptr() for t in shared.parameters()} if shared is not None else set()
    marked = 0
    for layer in (sub for top in modules for sub in top.modules()):
        weight = layer._parameters.get("weight") if isinstance(layer, Linear) else None
        if (weight is not None and weight.dtype == torch.float32 and weight.device.type == "cpu"
                and weight.data_ptr() not in kept):
            layer.__dict__["panel_dtype"] = dtype
            for attr in (*_PLAN_ATTRS, "_panel_weight", "_panel_fused"):
                layer.__dict__.pop(attr, None)
            marked += 1
    return marked


def _panel_dtype(layer: Linear) -> torch.dtype:
    """The dtype the layer's weight is packed in for the panel GEMM (`pack_weights_in`): its own unless set."""
    return layer.__dict__.get("panel_dtype", layer._parameters["weight"].dtype)


def _panel_weight(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The weight as its panels hold it: in `dtype`, and in bfloat16 also where it is fp32 whose every value is
    a bfloat16 (a checkpoint stored in bfloat16, loaded in fp32). The panel GEMM widens bfloat16 exactly, so
    those panels compute bit for bit what fp32 ones do, reading half the bytes."""
    weight = weight.to(dtype).contiguous()
    if dtype == torch.float32:
        rounded = weight.to(torch.bfloat16)
        if torch.equal(rounded.float(), weight):
            return rounded
    return weight


def make_plans(modules: Iterable[nn.Module]) -> int:
    """Makes the plan of every `Linear` layer of the modules and of every fused group (`fused_linears`) that
    the fast path would run, without running one: what a compiled step calls (`_traced_plan`), where a layer
    without a plan would trace as aten's linear (MKL, whose rows need not agree from one row count to the
    next). A layer that runs only in its group gets the group's plan alone. -> the plans made."""
    subs = [sub for top in modules for sub in top.modules()]
    groups = [group for sub in subs for group in getattr(sub, "fused_linears", tuple)()]
    grouped = {id(layer) for group in groups for layer in group}
    groups += [(sub,) for sub in subs if isinstance(sub, Linear) and id(sub) not in grouped]
    made = 0
    for group in groups:
        weight = group[0]._parameters.get("weight")
        if (weight is not None and weight.device.type == "cpu" and onednn_linear_available(weight.dtype)
                and (len(group) == 1 and _holds_own(group[0]) or len(group) > 1 and _alike(group))):
            with torch.inference_mode():
                _plan(group)
            made += 1
    return made


def panel_plan(layers: tuple[Linear, ...]) -> tuple[torch.Tensor, torch.Tensor | None, int] | None:
    """(panels, bias, out_features) of what the fast path runs for these layers (one, or a fused group) where
    that is the panel GEMM: what a caller that runs `draftsmith_cpu::panel_linear` itself passes it, the
    same call a layer makes. None where the layers take another form (or autograd is on)."""
    weight = layers[0]._parameters.get("weight")
    if (weight is None or weight.device.type != "cpu" or torch.is_grad_enabled()
            or not onednn_linear_available(weight.dtype) or not all(_holds_own(layer) for layer in layers)
            or len(layers) > 1 and not _alike(layers)):
        return None
    plan = _plan(layers)
    return (plan.weight, plan.bias, plan.out_features) if plan.form == "panel" else None


def _fast_path(x: torch.Tensor, weight: torch.Tensor) -> bool:
    # Under autocast aten's linear computes in the autocast dtype; the fast path would not, so it steps aside.
    return (x.device.type == "cpu" and x.dtype == weight.dtype and not torch.is_grad_enabled()
            and not torch.is_autocast_enabled("cpu") and onednn_linear_available(weight.dtype))


def _plan_to_run(layers: tuple[Linear, ...]) -> _Plan | None:
    """The plan a call runs: checked (`_plan`) when eager, the one already made when traced (`_traced_plan`)."""
    return _traced_plan(layers) if torch.compiler.is_compiling() else _plan(layers)


def _traced_plan(layers: tuple[Linear, ...]) -> _Plan | None:
    """Traced by torch.compile (`serve.engine.step_graphs`), a layer runs the plan made before the trace
    (`make_plans`) or by an eager call, unchecked: the graph guards on the plan object, so a plan an eager
    call makes again (a weight replaced or changed in place) recompiles, but a weight changed in place after
    the trace is not seen by compiled calls until then. Without a plan: aten's linear."""
    return layers[0].__dict__.get(_PLAN_ATTRS[len(layers) > 1])


def _checked_rows() -> list[int]:
    """The row counts `_mm_rows_agree` compares: every count to 160 (decode, verifies of up to 16 rows of 10
    tokens, draft steps), every fourth to 512, then an eighth apart up to MM_CHECKED_ROWS."""
    rows = [n for n in [*range(2, 161), *range(164, 513, 4)] if n < MM_CHECKED_ROWS]
    while max(rows[-1] + 1, rows[-1] * 9 // 8) < MM_CHECKED_ROWS:
        rows.append(max(rows[-1] + 1, rows[-1] * 9 // 8))
    return rows + [MM_CHECKED_ROWS]


def _mm_rows_agree(out_features: int, in_features: int, bias: bool) -> bool:
    """Whether MKL's GEMM on a transposed weight of this shape gives each row the same result at every
    checked row count as at the largest (random values: a different order of sums shows)."""
    generator = torch.Generator().manual_seed(0)
    transposed = torch.randn(in_features, out_features, generator=generator)
    offsets = torch.randn(out_features, generator=generator) if bias else None
    rows = _checked_rows()
    x = torch.randn(rows[-1], in_features, generator=generator)
    with torch.inference_mode():
        whole = _mm(x, transposed, offsets)
        return all(torch.equal(_mm(x[:n], transposed, offsets), whole[:n]) for n in rows[:-1])


def _mm(x: torch.Tensor, transposed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.mm(x, transposed) if bias is None else torch.addmm(bias, x, transposed)


def _takes_mm(out_features: int, layers: tuple[Linear, ...]) -> bool:
    first = layers[0]
    if (first.weight.dtype != torch.float32 or out_features * first.in_features * 4 > MM_UP_TO_BYTES
            or os.environ.get("DRAFTSMITH_CPU_LINEAR", "").lower() == "onednn"):
        return False
    key = (out_features, first.in_features, first.bias is not None, torch.get_num_threads())
    agrees = _mm_agrees.get(key)
    if agrees is None:
        agrees = _mm_agrees[key] = _mm_rows_agree(*key[:3])
    return agrees


def panels_run(dtype: torch.dtype) -> bool:
    """Whether CPU layers of this dtype run on the panel GEMM: fp32, the build loaded in this process, with
    AVX-512, not turned off (`DRAFTSMITH_CPU_LINEAR`)."""
    return (dtype == torch.float32 and slot_attention_cpu.LOADED
            and os.environ.get("DRAFTSMITH_CPU_LINEAR", "").lower() not in ("onednn", "aten") and _panels_built())


def _takes_panels(layers: tuple[Linear, ...]) -> bool:
    return panels_run(layers[0].weight.dtype)


@functools.cache
def _panels_built() -> bool:
    return bool(torch.ops.draftsmith_cpu.panel_linear_available())


def _project(plan: _Plan, x: torch.Tensor) -> torch.Tensor:
    """The outputs of a plan's layers side by side (one layer, or a fused group's stacked weights)."""
    if plan.form == "panel":
        return torch.ops.draftsmith_cpu.panel_linear.default(x, plan.weight, plan.bias, plan.out_features)
    if plan.form == "onednn":
        return _run(x, plan.weight, plan.bias)
    return _mm_rows(x, plan.weight, plan.bias)


def _mm_rows(x: torch.Tensor, transposed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """MKL's GEMM of x [..., in] on a transposed weight, in the row counts whose results `_mm_rows_agree`
    checked: one row runs as two, and more than MM_CHECKED_ROWS in pieces."""
    in_features = x.shape[-1]
    rows = x.numel() // in_features if in_features else 0
    flat = x.reshape(rows, in_features).contiguous()
    if rows == 1:
        out = _mm(F.pad(flat, (0, 0, 0, 1)), transposed, bias)[:1]
    elif rows <= MM_CHECKED_ROWS:
        out = _mm(flat, transposed, bias)
    else:  # in pieces of checked sizes: MM_CHECKED_ROWS - 2 rows each, the last 3 to MM_CHECKED_ROWS
        step = MM_CHECKED_ROWS - 2
        starts = range(0, rows - 2, step)
        ends = [*starts[1:], rows]
        out = torch.cat([_mm(flat[start:end], transposed, bias) for start, end in zip(starts, ends)])
    return out.view(*x.shape[:-1], out.shape[-1])


_PLAN_ATTRS = ("_plan", "_fused_plan")  # where a layer keeps its own plan and its group's


class _Plan(NamedTuple):
    """How a layer, or a fused group, runs on the fast path, and what that was decided from."""

    # (tensor, its data_ptr, its version or None for an inference tensor, a view of its storage) of each weight
    # and bias it was built from: a replaced parameter, a swapped .data or an in-place change (load_state_dict
    # copies in) shows. The view keeps the storage alive, so a swapped .data cannot land at the same address.
    # An inference tensor changed in place does not show (it keeps no version).
    tensors: tuple
    threads: int  # MKL's batch invariance, and so the form, depends on the thread count
    loaded: bool  # whether the C++ build was loaded (the panel form needs it)
    # "panel": packed for the panel GEMM (`_takes_panels`); "onednn": a reordered weight; "mm": MKL's GEMM on a
    # transposed copy (`_takes_mm`)
    form: str
    weight: torch.Tensor  # the weights stacked, in that form
    bias: torch.Tensor | None
    sizes: list[int]  # each layer's out_features, where a fused result splits
    out_features: int


def _plan(layers: tuple[Linear, ...]) -> _Plan:
    """The group's plan, cached on its first layer (a layer alone and in a group apart) and made again when a
    weight or bias was replaced or changed in place (a version bump: in-place updates, load_state_dict) or
    the thread count moved. Checking that is most of the per-call cost on the fast path: it reads each
    tensor from the module's own dicts, not through nn.Module's attribute lookup (a microsecond each)."""
    first = layers[0]
    plan = first.__dict__.get(_PLAN_ATTRS[len(layers) > 1])
    if (plan is not None and plan.threads == torch.get_num_threads() and plan.loaded == slot_attention_cpu.LOADED
            and _unchanged(layers, plan.tensors)):
        return plan
    return _new_plan(layers)


def _tensors_of(layers: tuple[Linear, ...]) -> list[torch.Tensor]:
    return [t for layer in layers for t in (layer._parameters["weight"], layer._parameters["bias"]) if t is not None]


def _unchanged(layers: tuple[Linear, ...], built_from: tuple) -> bool:
    tensors = _tensors_of(layers)
    if len(tensors) != len(built_from):
        return False
    for tensor, (was, address, version, _) in zip(tensors, built_from):
        if tensor is not was or tensor.data_ptr() != address or (version is not None and tensor._version != version):
            return False
    return True


def _new_plan(layers: tuple[Linear, ...]) -> _Plan:
    out_features = sum(layer.out_features for layer in layers)
    form = "panel" if _takes_panels(layers) else "mm" if _takes_mm(out_features, layers) else "onednn"
    weight, bias = _cached_weight(layers, form)
    tensors = tuple((t, t.data_ptr(), None if t.is_inference() else t._version, t.detach())
                    for t in _tensors_of(layers))
    plan = _Plan(tensors, torch.get_num_threads(), slot_attention_cpu.LOADED, form, weight, bias,
                 [layer.out_features for layer in layers], out_features)
    layers[0].__dict__[_PLAN_ATTRS[len(layers) > 1]] = plan
    return plan


def _weight_key(weight: torch.Tensor) -> tuple:
    return weight.data_ptr(), weight.dtype, 0 if weight.is_inference() else weight._version


def _cached_weight(layers: tuple[Linear, ...], form: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The layers' weights stacked, in `form` ("panel": packed in column panels; "onednn": reordered for oneDNN;
    "mm": transposed for MKL), and
    their bias: cached on the first layer (a layer alone and a group apart) and rebuilt when any weight or
    bias changes (in-place updates bump its version, load_state_dict copies into it)."""
    first = layers[0]
    attr = f"_{form}_{'weight' if len(layers) == 1 else 'fused'}"
    key = tuple(_weight_key(t) for layer in layers for t in (layer.weight, layer.bias) if t is not None)
    cached = first.__dict__.get(attr)
    if cached is None or cached[0] != key:
        with torch.inference_mode():
            if len(layers) == 1:
                weight, bias = first.weight.detach(), first.bias
            else:
                weight = torch.cat([layer.weight.detach() for layer in layers])
                bias = None if first.bias is None else torch.cat([layer.bias.detach() for layer in layers])
            if form == "panel":
                cached = (key, torch.ops.draftsmith_cpu.pack_panels(_panel_weight(weight, _panel_dtype(first))), bias)
            elif form == "mm":
                cached = (key, weight.t().contiguous(), bias)
            else:
                cached = (key, torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), REORDER_ROWS), bias)
        first.__dict__[attr] = cached
    return cached[1], cached[2]


def _run(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """oneDNN's linear on a reordered weight, rows padded to their bucket."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    padded = row_bucket(rows)
    linear = torch.ops.mkldnn._linear_pointwise.default
    if padded == rows:
        return linear(x.contiguous(), packed, bias, "none", [], "")
    flat = x.new_empty(padded, x.shape[-1])  # the rows copied once, only the padding zeroed
    flat[:rows] = x.reshape(rows, x.shape[-1])
    flat[rows:].zero_()
    out = linear(flat, packed, bias, "none", [], "")
    return out[:rows].view(*x.shape[:-1], out.shape[-1])


def fused(layers: tuple[Linear, ...], x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """`layer(x) for layer in layers` (same input size and dtype; q/k/v, gate/up), in one oneDNN call on
    their weights stacked (`_cached_weight`). oneDNN spends about 15 us a call whatever its size at one to a
    few rows: a one-row decode of the demo target runs 43 projections of a few hundred columns each, and 18
    of them were such calls more than needed. The outputs are views into one [.., sum of out_features]
    result. Off the fast path (autograd, GPU, another dtype): each layer on its own."""
    first = layers[0]
    if len(layers) == 1 or not _alike(layers) or not _fast_path(x, first._parameters["weight"]):
        return tuple(layer(x) for layer in layers)
    plan = _plan_to_run(layers)
    if plan is None:
        return tuple(layer(x) for layer in layers)
    return _project(plan, x).split(plan.sizes, dim=-1)


def _holds_own(layer: Linear) -> bool:
    """Whether the layer's weight and bias (None or not) are its own parameters: a wrapper may hold either as a
    plain attribute instead (FSDP's flat parameters, pruning, parametrizations), which the fast path, reading
    the module's own dict, would not see; such a layer takes aten's path."""
    own = layer._parameters
    return own.get("weight") is not None and "bias" in own


def _alike(layers: tuple[Linear, ...]) -> bool:
    """Whether the layers hold their own weights (see `Linear.forward`), of one dtype, packed in one dtype, and
    all or none a bias (what stacking them needs)."""
    if not all(_holds_own(layer) for layer in layers):
        return False
    weights = [layer._parameters["weight"] for layer in layers]
    biased = [layer._parameters["bias"] is not None for layer in layers]
    packed = {_panel_dtype(layer) for layer in layers}
    return (all(weight.dtype == weights[0].dtype for weight in weights) and all(b == biased[0] for b in biased)
            and len(packed) == 1)


class Linear(nn.Linear):
    """nn.Linear (same parameters, same state dict) whose CPU inference runs oneDNN on a reordered weight."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self._parameters.get("weight")
        if not _holds_own(self) or not _fast_path(x, weight):
            return F.linear(x, self.weight, self.bias)
        plan = _plan_to_run((self,))
        if plan is None:
            return F.linear(x, self.weight, self.bias)
        return _project(plan, x)

    def __getstate__(self):
        # the reordered copies are caches (opaque tensors that do not pickle): copies rebuild their own
        state = self.__dict__.copy()
        for attr in ("_onednn_weight", "_onednn_fused", "_mm_weight", "_mm_fused", *_PLAN_ATTRS):
            state.pop(attr, None)
        return state
