"""A recurrent head's forwards while drafting on CPU as one C++ op each (draft_step_cpu.cpp): `FusedDraftSteps`.

A propose of an EAGLE-3, EAGLE-1 or MTP head runs the head over each row's newly verified positions (the
catch-up, a few queries a row, whose last yields draft 1), then one query a row per draft 2..k. On two cores
an eager draft step of the demo EAGLE-3 head took about 300 us, of which its kernels were about 110, and its
catch-up about 600. The rest was Python: around each part (a norm, a projection, the rope, the cache writes,
the attention) the eager forward made a module call and a few op calls, and each built its ForwardBatch.
The fused op runs the same kernels in the same order from C++ (draft steps 108 us, the catch-up 300 with its
host work), so its drafts are the eager forward's bit for bit wherever that attends through the slot kernel
too (tests/unit/test_fused_draft_steps.py). Where an eager batch gathers its rows' keys instead (rows whose
contexts lie far apart: `ForwardBatch.build`), PyTorch's attention sums in another order, and the drafts may
differ in the last bits of their logits; they are proposals the target checks either way. A catch-up of more
than CATCH_UP_QUERIES positions (a new prompt's) stays eager: an eager forward attends those otherwise.

A greedy draft loop runs its steps 2..k as one op more (`greedy_steps`, `draftsmith_cpu::recurrent_draft_loop`):
each step, the pick (`greedy_pick`, as the proposer's `_choose`) and the proposer's rule for stopping early,
in C++: at k = 5 on the demo EAGLE-3 head, a propose took 0.89 ms against 1.06 stepping from Python.

It runs where the eager forward would run these kernels: a CPU process that loaded the build, fp32
throughout, every projection on the panel GEMM (`models.linear.panel_plan`), and a head that declares its
parts (`fused_step_parts`; None for the variants the op does not run: q/k norms, more than one layer), with the
C++ slot kernel wanted for attention (`DRAFTSMITH_ATTENTION`). An
attention window asks nothing more of a draft step: each row reads keys from a first key the proposer sets
by the window. Elsewhere the proposer's eager forwards run (and P-EAGLE and trees, which take no runner).
`DRAFTSMITH_CPU_OPS=torch` turns it off with the other step ops.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from draftsmith.errors import DraftsmithError
from draftsmith.models import step_ops_cpu
from draftsmith.models.kernel_backend import slot_kernel_wanted
from draftsmith.models.kv_cache import SLOT_KERNEL_QUERIES, KVCache
from draftsmith.models.linear import Linear, panel_plan

# the most positions a row's catch-up runs through the op: past them an eager forward attends otherwise (the
# prompt kernel, PyTorch's), and a long catch-up (a new prompt) is a one-off
CATCH_UP_QUERIES = SLOT_KERNEL_QUERIES


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
    zero_first_embedding: bool = False  # the embedding at position 0 is zero (MTP: no token before the first)


class FusedDraftSteps:
    """Runs a head's one-token draft steps as `draftsmith_cpu::recurrent_draft_step`, with the interface of
    `serve.engine.step_graphs.DraftStepRunner`: `begin` once per draft loop, then `step` for drafts 2, 3, ...
    of the same rows."""

    def __init__(self, head, cache: KVCache, parts: FusedStepParts):
        self.head, self.cache, self.parts = head, cache, parts
        norms = [norm for norm in parts.norms if norm is not None]
        self.eps = norms[0].eps
        self.flags = [int(parts.state_first), int(parts.normed_residual), int(parts.feed_back_normed),
                      int(parts.zero_first_embedding)]
        self._loop: tuple | None = None

    @classmethod
    def for_head(cls, head, cache: KVCache) -> FusedDraftSteps | None:
        """The runner for this head and cache, or None where the fused op does not run its steps (module
        docstring): the caller keeps its eager steps."""
        parts_of = getattr(head, "fused_step_parts", None)
        parts = parts_of() if parts_of is not None else None
        # the op attends through the C++ slot kernel, as the eager forward does only where that is wanted
        if (parts is None or not step_ops_cpu.enabled() or cache.k[0].device.type != "cpu"
                or not slot_kernel_wanted(cache.k[0].device)):
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

    @property
    def state_width(self) -> int:
        """The width of the state a step takes (the head's output fed back): its embedding's."""
        return self.parts.embedding.shape[1]

    def begin(self, slots: list[int], base: list[int], key_starts: list[int]) -> None:
        """A draft loop over rows in `slots` whose first step sits at `base` and reads keys from
        `key_starts` on."""
        self._loop = (torch.tensor(base), torch.tensor(slots), torch.tensor(key_starts), self._checked_weights(), 0)

    def step(self, ids: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """ids [rows] (the last drafts, target ids), state [rows, H] (the head's last outputs) -> (head output
        [rows, H], logits [rows, vocab]) one position further on."""
        base, slots, key_starts, weights, step = self._loop
        self._loop = (base, slots, key_starts, weights, step + 1)
        return self._run(ids, state, base, step, None, slots, key_starts, None, weights)

    def greedy_steps(self, ids: torch.Tensor, state: torch.Tensor, first: int, steps: int, d2t: torch.Tensor | None,
                     drafted: torch.Tensor, probs: torch.Tensor, product: torch.Tensor, limits: torch.Tensor | None,
                     stop_below: float, batch_rows: int) -> int:
        """Greedy draft steps first..steps - 1 of the loop `begin` opened, each picked as `greedy_pick` picks
        (d2t: the draft-to-target offsets), as one op (`draftsmith_cpu::recurrent_draft_loop`): ids [A] and state
        [A, H], step first - 1's choices and head output; into drafted and probs [A, k] at each step's column.
        With stop_below > 0 it stops where the proposer's loop would (`product`: the rows' running product of
        probabilities through step first - 1; `limits`: each row's most drafts, None where all draft every
        step) -> the draft steps run in all."""
        base, slots, key_starts, weights, _ = self._loop
        return torch.ops.draftsmith_cpu.recurrent_draft_loop.default(
            ids, state, base, first, steps, slots, key_starts, *self._head_args(weights), d2t, drafted, probs,
            product, limits, stop_below, batch_rows)

    def catch_up(self, ids: torch.Tensor, features: torch.Tensor, first: list[int], held: list[int],
                 slots: list[int], key_starts: list[int], window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The head over each row's pending positions (ids [rows, W], target features [rows, W, F]; row b's
        first held[b] real, from position first[b]) -> (head output [rows, H], logits [rows, vocab]) at each
        row's last one, which yield draft 1. Only for rows of at most CATCH_UP_QUERIES positions."""
        counts = None if min(held) == ids.shape[1] else torch.tensor(held)
        return self._run(ids, self.head.state_from_target(features), torch.tensor(first), 0, counts,
                         torch.tensor(slots), torch.tensor(key_starts), window, self._checked_weights())

    def _checked_weights(self) -> tuple[list, list, list, list]:
        weights = self._weights()
        if weights is None:  # the panel GEMM turned off (DRAFTSMITH_CPU_LINEAR) in a serving process
            raise DraftsmithError("a draft head's projections left the panel GEMM while its engine served: "
                                  "restart the engine")
        return weights

    def _run(self, ids, state, base, step, held, slots, key_starts, window, weights):
        return torch.ops.draftsmith_cpu.recurrent_draft_step.default(
            ids, state, base, step, held, slots, key_starts, window, *self._head_args(weights))

    def _head_args(self, weights: tuple) -> tuple:
        """The head's part of both ops' arguments, from the embedding to the flags, in their schemas' order."""
        norms, panels, biases, widths = weights
        parts, head = self.parts, self.head
        return (parts.embedding, norms, panels, biases, widths, self.cache.k[0], self.cache.v[0], head.rope_cos,
                head.rope_sin, parts.heads, parts.kv_heads, self.eps, self.flags)

    def warm_up(self) -> int:
        """Nothing to capture or compile: -> 0 buckets."""
        return 0
