"""A recurrent head's one-token draft steps on CPU as one C++ op each (draft_step_cpu.cpp): `FusedDraftSteps`.

The steps after a head's catch-up (EAGLE-3, EAGLE-1 and MTP drafts 2..k) run at one query a row: about 300
us each on two cores for the demo EAGLE-3 head, of which its kernels were about 110. The rest was Python:
around each part (a norm, a projection, the rope, the cache writes, the attention) the eager step made a
module call and a few op calls, and the draft loop built each step's ForwardBatch. The fused op runs the
same kernels in the same order from C++ (108 us a step), so its drafts are the eager step's bit for bit
wherever the eager step attends through the slot kernel too (tests/unit/test_fused_draft_steps.py). Where
an eager batch gathers its rows' keys instead (rows whose contexts lie far apart: `ForwardBatch.build`),
PyTorch's attention sums in another order, and the drafts may differ in the last bits of their logits; they
are proposals the target checks either way.

It runs where the eager step would run these kernels: a CPU process that loaded the build, fp32 throughout,
every projection on the panel GEMM (`models.linear.panel_plan`), and a head that declares its parts
(`fused_step_parts`; None for the variants the op does not run: q/k norms, more than one layer). An attention
window asks nothing more of it: each row's steps read keys from a first key the proposer sets by the window. Elsewhere the proposer's eager steps run. `DRAFTSMITH_CPU_OPS=torch` turns it off with the other step
ops.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from draftsmith.models import step_ops_cpu
from draftsmith.models.kv_cache import KVCache
from draftsmith.models.linear import Linear, panel_plan


@dataclass(frozen=True)
class FusedStepParts:
    """The modules a head's one-token step reads, in the op's order (draft_step_cpu.cpp states what each does);
    None where the head has no such part."""

    embedding: torch.Tensor  # [vocab, H], the table the head embeds its draft tokens with
    # RMSNorms: the embedding's, the state's, the attention input's (after the input projection), the one after
    # attention, the final one
    norms: tuple[torch.nn.Module | None, ...]
    # the input projection (EAGLE-1's fc, MTP's input_proj), (q, k, v), (o,), (gate, up), (down,), (LM head,)
    projections: tuple[tuple[Linear, ...] | None, ...]
    heads: int
    kv_heads: int
    state_first: bool = False  # the state comes before the embedding where they are joined
    normed_residual: bool = False  # without an input projection: the layer's residual is the normed state
    feed_back_normed: bool = False  # the final norm's output is what is fed back


class FusedDraftSteps:
    """Runs a head's one-token draft steps as `draftsmith_cpu::recurrent_draft_step`, with the interface of
    `serve.engine.step_graphs.DraftStepRunner`: `begin` once per draft loop, then `step` for drafts 2, 3, ...
    of the same rows."""

    def __init__(self, head, cache: KVCache, parts: FusedStepParts):
        self.head, self.cache, self.parts = head, cache, parts
        norms = [norm for norm in parts.norms if norm is not None]
        self.eps = norms[0].eps
        self.flags = [int(parts.state_first), int(parts.normed_residual), int(parts.feed_back_normed)]
        self._loop: tuple | None = None

    @classmethod
    def for_head(cls, head, cache: KVCache) -> FusedDraftSteps | None:
        """The runner for this head and cache, or None where the fused op does not run its steps (module
        docstring): the caller keeps its eager steps."""
        parts_of = getattr(head, "fused_step_parts", None)
        parts = parts_of() if parts_of is not None else None
        if parts is None or not step_ops_cpu.enabled() or cache.k[0].device.type != "cpu":
            return None
        if head.rope_cos is None:
            head.init_rope(head.layer_shape.max_position_embeddings)
        norms = [norm for norm in parts.norms if norm is not None]
        tensors = [parts.embedding, cache.k[0], head.rope_cos, head.rope_sin, *(norm.weight for norm in norms)]
        if any(t.dtype != torch.float32 for t in tensors) or len({norm.eps for norm in norms}) != 1:
            return None
        runner = cls(head, cache, parts)
        with torch.inference_mode():
            return runner if runner._weights() is not None else None

    def _weights(self) -> tuple[list, list, list, list] | None:
        """(norm weights, panels, biases, out_features) as the layers' own calls would run them (None, None, 0
        for a projection the head has not); None where a projection is not on the panel GEMM. Read at each
        loop's start: a plan is made again when a weight changed."""
        plans = [None if group is None else panel_plan(group) for group in self.parts.projections]
        if any(plan is None for plan, group in zip(plans, self.parts.projections) if group is not None):
            return None
        norms = [None if norm is None else norm.weight for norm in self.parts.norms]
        return (norms, [p[0] if p else None for p in plans], [p[1] if p else None for p in plans],
                [p[2] if p else 0 for p in plans])

    def begin(self, slots: list[int], base: list[int], key_starts: list[int]) -> None:
        """A draft loop over rows in `slots` whose first step sits at `base` and reads keys from
        `key_starts` on."""
        weights = self._weights()
        if weights is None:
            raise RuntimeError("a draft head's projection left the panel GEMM while its engine served")
        self._loop = (torch.tensor(base), torch.tensor(slots), torch.tensor(key_starts), weights, 0)

    def step(self, ids: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """ids [rows] (the last drafts, target ids), state [rows, H] (the head's last outputs) -> (head output
        [rows, H], logits [rows, vocab]) one position further on."""
        base, slots, key_starts, weights, step = self._loop
        self._loop = (base, slots, key_starts, weights, step + 1)
        norms, panels, biases, widths = weights
        parts, head = self.parts, self.head
        return torch.ops.draftsmith_cpu.recurrent_draft_step.default(
            ids, state, base, step, slots, key_starts, parts.embedding, norms, panels, biases, widths,
            self.cache.k[0], self.cache.v[0], head.rope_cos, head.rope_sin, parts.heads, parts.kv_heads, self.eps,
            self.flags)

    def warm_up(self) -> int:
        """Nothing to capture or compile: -> 0 buckets."""
        return 0
