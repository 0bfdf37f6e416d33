"""Decode and verify forwards at static shapes: captured as CUDA graphs, or traced by torch.compile.

An eager step on a GPU is bound by its launches: each of a few hundred small kernels waits on Python
between them. A static step takes that away. Its rows are padded to a bucket (powers of two up to
`max_num_seqs`), its queries per row to the step's width (1 to decode, 1 + drafts to verify: each width its
own bucket), and every value the forward reads from the scheduler sits in one static buffer refilled per
step: token ids, positions, the slots written and read, each row's key count. The forward (`static_forward`)
derives its attention metadata from that buffer on the device (`ForwardBatch.static`) and reads nothing back
to the host, so a CUDA graph captures it once per bucket and replays it; the Triton slot kernel reads each
row's keys up to its own count in place, so one graph serves every context length.

On CPU the same function runs under `torch.compile(fullgraph=True)` (`--step-mode compile`): Inductor fuses
the small ops around the projections (norms, rope, residuals, the attention's masking and softmax), which
eager code pays 5-20 us each for, and the projections stay oneDNN's linear on the weights `models.linear`
reordered (`onednn_linear_in_graphs`, `models.linear.make_plans`), so a row computes alike whatever the
step's other rows. Compiled steps run faster than eager ones at one request in flight and at eight (figures in
docs/decisions/cpu-kernels.md). The engine does not pick it by default: each bucket compiles for 5-15 s on
two cores when the engine starts.
Eager stays the reference path and `--enforce-eager` (vLLM's name) keeps it.

A recurrent draft head's one-token steps (EAGLE drafts 2..k) run the same way (`DraftStepRunner`): rows
padded to a bucket, each row's position, slot and first key in a static buffer, the head's input token and
state in two more; each step moves the positions on by one on the device. Prefill chunks and a head's
catch-up over newly verified positions stay eager: their shapes change with every prompt and step.
An eager engine on CPU runs those steps, and the catch-up, as one C++ op each instead
(`models.draft_step_cpu`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from draftsmith.errors import DraftsmithError
from draftsmith.models.kernel_backend import slot_kernel_wanted
from draftsmith.models.kv_cache import SLOT_KERNEL_QUERIES, ForwardBatch, KVCache
from draftsmith.models.linear import make_plans
from draftsmith.models.llama import CausalLM, ForwardOutput

logger = logging.getLogger("draftsmith")

STEP_MODES = ("auto", "eager", "cuda-graph", "compile")
RECOMPILE_LIMIT = 64
ACCUMULATED_RECOMPILE_LIMIT = 4096


def onednn_linear_in_graphs() -> None:
    """Lets a compiled CPU step call oneDNN's linear on the weights `models.linear` reordered, as eager steps
    do (the same kernel on the same layout: a row's result does not depend on the step's other rows). Inductor
    lowers that op only for weights frozen into the graph (its freezing pass); registered as a fallback, the
    graph calls the op as eager code does. Inductor's oneDNN fusion pass rewrites a linear followed by an add
    (a residual) into the op's binary form, whose lowering needs frozen weights too: here that form is the
    linear, then the add, as eager code runs them."""
    from torch._inductor import lowering

    linear, with_add = torch.ops.mkldnn._linear_pointwise.default, torch.ops.mkldnn._linear_pointwise.binary
    if linear in lowering.fallbacks:
        return
    lowering.lowerings.pop(linear, None)
    lowering.make_fallback(linear, warn=False)
    unfused = {"add": lowering.lowerings[torch.ops.aten.add.Tensor],
               "sub": lowering.lowerings[torch.ops.aten.sub.Tensor]}

    def linear_then(x, other, weight, bias, attr):
        return unfused[attr](lowering.lowerings[linear](x, weight, bias, "none", [], ""), other)

    lowering.lowerings[with_add] = linear_then


def compile_step(fn, backend: str = "inductor"):
    """`fn` under torch.compile(fullgraph=True) for one runner, whose model (or head) no other runner's calls
    reach: its graphs are kept apart from every other compile of the same function (`isolate_recompiles`),
    up to RECOMPILE_LIMIT of them (Dynamo's default of 8 is met by one engine's buckets), and a call checks
    no guard on the modules. Those were about 1,300 of a graph's 1,430 guards, and Dynamo evaluates every
    entry's guards until one passes: 550 us of each house-model step at 8 rows, 150 us without them. A runner's
    modules are never replaced while it serves; their weights are read as graph inputs at every call."""
    # Dynamo's cap on graphs over all compiles in the process (256) is met by a bench's engines side by side
    torch._dynamo.config.accumulated_recompile_limit = max(torch._dynamo.config.accumulated_recompile_limit,
                                                           ACCUMULATED_RECOMPILE_LIMIT)
    return torch.compile(fn, fullgraph=True, backend=backend, recompile_limit=RECOMPILE_LIMIT,
                         isolate_recompiles=True,
                         options={"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe})


def row_buckets(max_rows: int) -> list[int]:
    """1, 2, 4, ... up to max_rows, and max_rows itself."""
    buckets, rows = [], 1
    while rows < max_rows:
        buckets.append(rows)
        rows *= 2
    return buckets + [max_rows]


def static_forward(model: CausalLM, cache: KVCache, inputs: torch.Tensor, width: int, num_keys: int,
                   feature_layers: tuple[int, ...], slot_kernel: bool) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """One decode or verify forward from a static input buffer [rows, 3 * width + 2] (StepInputs' layout)
    -> logits [rows, width, vocab] (fp32) and the hidden states `feature_layers` [rows, width, hidden]."""
    ids, positions, write_slots = inputs[:, :width], inputs[:, width : 2 * width], inputs[:, 2 * width : 3 * width]
    read_slots, kv_lens = inputs[:, 3 * width].contiguous(), inputs[:, 3 * width + 1].contiguous()
    batch = ForwardBatch.static(positions, read_slots, write_slots, kv_lens, num_keys, model.config.sliding_window,
                                slot_kernel)
    out = model(ids, cache=cache, batch=batch, feature_layers=feature_layers)
    return out.logits, tuple(out.hidden_states[i] for i in feature_layers)


def static_draft_step(head, cache: KVCache, inputs: torch.Tensor, ids: torch.Tensor, state: torch.Tensor,
                      num_keys: int, slot_kernel: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One draft step of a recurrent head (its own output and draft fed back) from static buffers: inputs
    [rows, 3] (position, slot, first key read), ids [rows] (target ids), state [rows, H] -> (head output
    [rows, H], logits [rows, draft_vocab])."""
    positions, slots, key_starts = inputs[:, :1], inputs[:, 1].contiguous(), inputs[:, 2].contiguous()
    batch = ForwardBatch.static(positions, slots, inputs[:, 1:2], positions[:, 0] + 1, num_keys, None, slot_kernel,
                                key_starts)
    out, logits = head.step(ids[:, None], state[:, None], positions, False, cache, batch)
    return out[:, 0], logits[:, 0]


@dataclass
class _Bucket:
    inputs: torch.Tensor  # the static buffer on the device, [rows, 3 * width + 2]
    graph: torch.cuda.CUDAGraph | None = None
    outputs: tuple | None = None  # what the captured forward wrote: static, overwritten by each replay
    tensors: tuple = ()  # further static inputs (a draft step's ids and state)


def _rows_of(outputs, rows: int, copy: bool):
    """The outputs' real rows; copies of a replay's (the next replay overwrites them, and a proposer may keep
    hidden states past this step)."""
    if isinstance(outputs, tuple):
        return tuple(_rows_of(o, rows, copy) for o in outputs)
    return outputs[:rows].clone() if copy else outputs[:rows]


class _StaticSteps:
    """What both runners share: the row buckets, and running a static function per bucket in the mode
    (compiled once, or a CUDA graph captured per bucket and replayed)."""

    def __init__(self, fn, device: torch.device, max_rows: int, mode: str):
        self.fn, self.device, self.mode = fn, device, mode
        self.buckets = row_buckets(max_rows)
        self.slot_kernel = slot_kernel_wanted(device)
        self._steps: dict[tuple[int, int], _Bucket] = {}
        self._pool = None
        self._keys_varied = False  # `_warm_key_counts`
        if mode == "compile":
            onednn_linear_in_graphs()
            self._compiled = compile_step(fn)

    def _warm_key_counts(self, longest: int) -> list[int]:
        """The key counts a bucket's warm-up runs at: `longest`, and in mode compile at least 2, for Dynamo
        specialises 0 and 1 always (a decode bucket warmed at 1 key is guarded to 1 key, and compiles again at
        its first real step); once per runner two counts past 1. Dynamo compiles an int argument that has
        changed as a symbol from then on, so every later graph serves every key count; met first while
        serving, each bucket had compiled twice (10-20 s each on two cores)."""
        first = max(longest, 2)
        if self.mode != "compile":
            return [longest]
        if self._keys_varied or first + 1 > self.cache.max_len:
            return [first]
        self._keys_varied = True
        return [first, first + 1]

    def _execute(self, step: _Bucket, args: tuple, rows: int):
        with torch.inference_mode():
            if self.mode == "cuda-graph":
                if step.graph is None:
                    self._capture(step, args)
                step.graph.replay()
                return _rows_of(step.outputs, rows, copy=True)
            return _rows_of(self._compiled(*args), rows, copy=False)

    def _capture(self, step: _Bucket, args: tuple) -> None:
        """Captures the bucket's forward. The graph holds the addresses of the cache, the weights and the rope
        tables (sized at load for max_model_len: never rebuilt while serving). The buffers hold padding rows
        (warm-up) or a real step's inputs, whose cache writes the warm-up runs repeat exactly."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # compiles the Triton kernels and settles the allocator first
            for _ in range(2):
                self.fn(*args)
        torch.cuda.current_stream(self.device).wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            step.outputs = self.fn(*args)
        step.graph = graph
        logger.info("captured a %s graph: %d rows", self.fn.__name__, step.inputs.shape[0])


class StepRunner(_StaticSteps):
    """Runs the engine's decode and verify forwards at static shapes (the module docstring); built once per
    engine for a mode other than eager (`make_step_runner`)."""

    def __init__(self, model: CausalLM, cache: KVCache, max_rows: int, feature_layers: tuple[int, ...], mode: str):
        super().__init__(static_forward, model.model.embed_tokens.weight.device, max_rows, mode)
        self.model, self.cache = model, cache
        if mode == "compile":  # before the first trace: a layer without a plan traces as aten's linear
            make_plans([model])
        self.feature_layers = tuple(feature_layers)

    def forward(self, ids: torch.Tensor, slots: list[int], starts: list[int], q_lens: list[int]) -> ForwardOutput:
        """ids [B, W] (row b's first q_lens[b] real), rows in slots at starts -> logits [B, W, vocab] and the
        hidden states, as the eager forward returns them."""
        rows, width = ids.shape
        bucket_rows = next(b for b in self.buckets if b >= rows)
        step = self._bucket(bucket_rows, width)
        step.inputs.copy_(self._host_inputs(rows, bucket_rows, width, slots, starts, q_lens), non_blocking=True)
        step.inputs[:rows, :width].copy_(ids)  # drafts are on the device already
        logits, hidden = self._run(step, width, max(s + q for s, q in zip(starts, q_lens)), rows)
        return ForwardOutput(logits=logits, hidden_states=dict(zip(self.feature_layers, hidden)))

    def warm_up(self, widths: list[int]) -> int:
        """Captures (or compiles) every row bucket at each width now, on padding rows alone (they touch only
        the scratch slot), not in the first steps that meet them: a capture or compile timed as a step had
        made speculation look slower than it is. -> the buckets run."""
        for width in widths:
            for rows in self.buckets:
                step = self._bucket(rows, width)
                step.inputs.copy_(self._host_inputs(0, rows, width, [], [], []))
                for longest in self._warm_key_counts(width):
                    self._run(step, width, longest, 0)
        return len(widths) * len(self.buckets)

    def _bucket(self, rows: int, width: int) -> _Bucket:
        step = self._steps.get((rows, width))
        if step is None:
            step = self._steps[(rows, width)] = _Bucket(torch.zeros(rows, 3 * width + 2, dtype=torch.long,
                                                                    device=self.device))
        return step

    def _run(self, step: _Bucket, width: int, longest: int, rows: int):
        """The bucket's forward over keys up to `longest`; `rows` real ones (what a replay's outputs keep)."""
        # the kernel's tile stacks a KV group's heads times the queries: past this many queries a row, the
        # masked PyTorch form, as ForwardBatch.build decides
        kernel = self.slot_kernel and width <= SLOT_KERNEL_QUERIES
        # A graph replays the key count it was captured with: the whole cache (the kernel bounds each row by
        # its kv_lens; the mask form reads every key, masked). A compiled step reads the longest row's keys.
        num_keys = _keys_read(self.cache, longest, kernel, self.mode)
        return self._execute(step, (self.model, self.cache, step.inputs, width, num_keys, self.feature_layers,
                                    kernel), rows)

    def _host_inputs(self, rows: int, bucket_rows: int, width: int, slots: list[int], starts: list[int],
                     q_lens: list[int]) -> torch.Tensor:
        """The buffer's host copy for `rows` real rows (their ids are written on the device after). Padding
        queries write to the scratch slot; padding rows read it too, keys 0..width-1 (finite: zeros or other
        padding's writes)."""
        scratch = self.cache.scratch_slot
        host = torch.zeros(bucket_rows, 3 * width + 2, dtype=torch.long)
        offsets = torch.arange(width)
        start = torch.tensor(starts + [0] * (bucket_rows - rows))[:, None]
        host[:, width : 2 * width] = (start + offsets).clamp(max=self.cache.max_len - 1)
        real = offsets[None, :] < torch.tensor(q_lens + [0] * (bucket_rows - rows))[:, None]
        read = torch.tensor(slots + [scratch] * (bucket_rows - rows))
        host[:, 2 * width : 3 * width] = torch.where(real, read[:, None], scratch)
        host[:, 3 * width] = read
        host[:, 3 * width + 1] = torch.tensor([s + q for s, q in zip(starts, q_lens)] + [width] * (bucket_rows - rows))
        return host


def _keys_read(cache: KVCache, longest: int, kernel: bool, mode: str) -> int:
    """The key count a static step reads. A graph replays the count it was captured with: the whole cache (the
    kernel bounds each row by its kv_lens; the mask form reads every key, masked). A compiled step reads the
    longest row's keys: its graphs take the count as a symbol (`_warm_key_counts`)."""
    if kernel or mode == "cuda-graph":
        return cache.max_len
    return min(longest, cache.max_len)


class DraftStepRunner(_StaticSteps):
    """Runs a recurrent draft head's one-token steps at static shapes (the module docstring): `begin` once per
    draft loop, then `step` for drafts 2, 3, ... of the same rows."""

    def __init__(self, head, cache: KVCache, max_rows: int, mode: str):
        weight = next(head.parameters())
        super().__init__(static_draft_step, weight.device, max_rows, mode)
        self.head, self.cache = head, cache
        if mode == "compile":  # as StepRunner's
            make_plans([head])
        self.state_size, self.dtype = head.config.hidden_size, weight.dtype
        # this loop's bucket, its real rows, the keys its next step reads at most; and its first step's
        self._loop: tuple[_Bucket, int, int] | None = None
        self._first_longest = 0

    def begin(self, slots: list[int], base: list[int], key_starts: list[int]) -> None:
        """A draft loop over rows in `slots` whose first step sits at `base` and reads keys from
        `key_starts` on."""
        rows = len(slots)
        step = self._bucket(next(b for b in self.buckets if b >= rows))
        host = torch.zeros(step.inputs.shape, dtype=torch.long)
        host[:, 1] = self.cache.scratch_slot  # padding rows write and read the scratch slot, from position 0
        host[:rows, 0], host[:rows, 1], host[:rows, 2] = (torch.tensor(base), torch.tensor(slots),
                                                          torch.tensor(key_starts))
        step.inputs.copy_(host, non_blocking=True)
        self._first_longest = max(base) + 1
        self._loop = (step, rows, self._first_longest)

    def step(self, ids: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """ids [rows] (the last drafts, target ids), state [rows, H] (the head's last outputs) -> (head output
        [rows, H], logits [rows, draft_vocab]) one position further on."""
        step, rows, longest = self._loop
        if longest > self._first_longest:
            step.inputs[:, 0] += 1  # on the device: the loop's host values were copied once
        self._loop = (step, rows, longest + 1)
        step_ids, step_state = step.tensors
        step_ids[:rows].copy_(ids)
        step_state[:rows].copy_(state)
        return self._run(step, rows, longest)

    def warm_up(self) -> int:
        """Captures (or compiles) every bucket now, on padding rows alone (the scratch slot). -> buckets run."""
        for rows in self.buckets:
            step = self._bucket(rows)
            step.inputs.zero_()
            step.inputs[:, 1] = self.cache.scratch_slot
            for longest in self._warm_key_counts(1):
                self._run(step, 0, longest)
        return len(self.buckets)

    def _bucket(self, rows: int) -> _Bucket:
        step = self._steps.get((rows, 1))
        if step is None:
            step = self._steps[(rows, 1)] = _Bucket(
                torch.zeros(rows, 3, dtype=torch.long, device=self.device),
                tensors=(torch.zeros(rows, dtype=torch.long, device=self.device),
                         torch.zeros(rows, self.state_size, dtype=self.dtype, device=self.device)))
        return step

    def _run(self, step: _Bucket, rows: int, longest: int):
        kernel = self.slot_kernel  # one query a row
        num_keys = _keys_read(self.cache, longest, kernel, self.mode)
        return self._execute(step, (self.head, self.cache, step.inputs, *step.tensors, num_keys, kernel), rows)


def resolve_step_mode(mode: str, enforce_eager: bool, device: torch.device) -> str:
    """The mode an engine runs its decode and verify forwards in: one of STEP_MODES but auto (CUDA graphs on
    CUDA, eager elsewhere)."""
    if mode not in STEP_MODES:
        raise DraftsmithError(f"step mode {mode!r}: one of {', '.join(STEP_MODES)}")
    if enforce_eager:
        if mode not in ("auto", "eager"):
            raise DraftsmithError(f"enforce_eager runs every step eagerly; it cannot be combined with step mode {mode!r}")
        return "eager"
    if mode == "auto":
        return "cuda-graph" if device.type == "cuda" else "eager"
    if mode == "cuda-graph" and device.type != "cuda":
        raise DraftsmithError(f"step mode cuda-graph needs a CUDA device, and the model is on {device.type}")
    return mode


def make_step_runner(model: CausalLM, cache: KVCache, max_rows: int, feature_layers: tuple[int, ...],
                     mode: str) -> StepRunner | None:
    """The runner for a resolved mode; None for eager (the engine's own forwards)."""
    return None if mode == "eager" else StepRunner(model, cache, max_rows, feature_layers, mode)
