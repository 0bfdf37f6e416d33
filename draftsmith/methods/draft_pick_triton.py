# ruff: noqa: N803, N806
"""`greedy_pick`: a greedy draft step's pick as one Triton kernel (math in draft_pick_reference.py).

Eager PyTorch spends four kernels on it (softmax written out over the whole draft vocabulary, max, the d2t
gather, the add), and the softmax's [A, V] output is read back once more. Here one program per row streams
its logits once in BLOCK_V chunks, keeping the running max, its index and the online sum of exponentials;
the pick's probability is then 1 / sum. Nothing is read back to the host, so a draft step's pick adds no
sync (a CUDA graph could hold it).
"""

from __future__ import annotations

import torch

from draftsmith.models.kernel_backend import check_kernel_devices

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: proposers pick with the PyTorch reference
    triton = None

BLOCK_V = 1024


if triton is not None:

    @triton.jit
    def _greedy_pick_kernel(logits_ptr, d2t_ptr, ids_ptr, probs_ptr, stride_row, V,
                            HAS_D2T: tl.constexpr, BLOCK_V: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offsets = tl.arange(0, BLOCK_V)
        run_max = tl.full([1], float("-inf"), tl.float32)
        run_arg = tl.zeros([1], tl.int64)
        run_sum = tl.zeros([1], tl.float32)
        for start in range(0, V, BLOCK_V):
            cols = start + offsets
            x = tl.load(logits_ptr + row * stride_row + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
            block_max = tl.max(x, axis=0)
            block_arg = tl.argmax(x, axis=0).to(tl.int64) + start
            new_max = tl.maximum(run_max, block_max)
            # strictly greater: an earlier block keeps a tie (the first index wins, as torch.max)
            run_arg = tl.where(block_max > run_max, block_arg, run_arg)
            run_sum = run_sum * tl.exp(run_max - new_max) + tl.sum(tl.exp(x - new_max), axis=0)
            run_max = new_max
        ids = run_arg
        if HAS_D2T:
            ids = ids + tl.load(d2t_ptr + run_arg)
        one = tl.arange(0, 1)
        tl.store(ids_ptr + row + one, ids)
        tl.store(probs_ptr + row + one, 1.0 / run_sum)


def greedy_pick(logits: torch.Tensor, d2t: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [A, V] (rows contiguous), d2t [V] int64 or None -> (target ids [A] int64, probabilities [A] fp32)."""
    if triton is None:
        raise RuntimeError("greedy_pick needs Triton")
    check_kernel_devices("greedy_pick", logits=logits, d2t=d2t)
    rows, vocab = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    ids = torch.empty(rows, dtype=torch.int64, device=logits.device)
    probs = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if rows:
        _greedy_pick_kernel[(rows,)](logits, d2t if d2t is not None else ids, ids, probs, logits.stride(0), vocab,
                                     HAS_D2T=d2t is not None, BLOCK_V=BLOCK_V)
    return ids, probs
