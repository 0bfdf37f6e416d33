"""The learning-rate schedule and the wall-clock budget it follows.

The schedule is transformers' cosine with warm-up (linear up over the warm-up steps, then half a cosine to
zero), with one rule added: under `training.max_minutes` the cosine runs on whichever ends the run first,
its steps or its minutes. A recipe whose `max_steps` was sized on a faster machine, or beside other work,
would otherwise stop at its deadline with the learning rate still high, the run never annealed. The share of
the budget spent is read at each optimizer step, once the step is done, and agreed by every process, so
every rank steps the same learning rate.

A resumed run gets `max_minutes` anew (as its deadline does): its cosine goes on from where its steps put it
and ends with the new budget.
"""

from __future__ import annotations

import math

import torch
from torch.optim.lr_scheduler import LambdaLR


class TimeBudget:
    """A run's wall-clock budget in seconds from `begin`'s clock reading, and the share of it spent at the
    last reading."""

    def __init__(self, seconds: float):
        self.seconds, self.start, self.share = seconds, 0.0, 0.0

    def begin(self, now: float) -> None:
        self.start, self.share = now, 0.0

    def read(self, accelerator, now: float) -> float:
        """The share spent at `now`, the largest any process read (-> and kept in `share`)."""
        share = (now - self.start) / self.seconds
        if accelerator.num_processes > 1:
            agreed = accelerator.reduce(torch.tensor(share, device=accelerator.device), reduction="max")
            share = float(agreed)
        self.share = share
        return share


def cosine_schedule(optimizer, warmup_steps: int, total_steps: int, budget: TimeBudget | None) -> LambdaLR:
    """Linear warm-up over `warmup_steps`, then a cosine to zero at `total_steps` or at the end of `budget`,
    whichever comes first (steps as the scheduler counts them: once per process per optimizer step)."""

    def cosine(progress: float) -> float:
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0))))

    def factor(step: int) -> float:
        spent = budget.share if budget is not None else 0.0
        if step < warmup_steps:  # a budget that ends inside the warm-up caps the ramp
            return min(step / max(1, warmup_steps), cosine(spent))
        return cosine(max((step - warmup_steps) / max(1, total_steps - warmup_steps), spent))

    return LambdaLR(optimizer, factor)
