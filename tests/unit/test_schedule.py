"""The LR schedule (train/schedule.py): transformers' cosine with warm-up, ending with the wall-clock budget
where that comes first."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from transformers import get_cosine_schedule_with_warmup

from draftsmith.train.schedule import TimeBudget, cosine_schedule

ONE_PROCESS = SimpleNamespace(num_processes=1)


def _rates(scheduler, optimizer, steps: int, between=lambda step: None) -> list[float]:
    rates = []
    for step in range(steps):
        optimizer.step()
        scheduler.step()
        between(step)
        rates.append(scheduler.get_last_lr()[0])
    return rates


def _optimizer():
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2.0)


@pytest.mark.parametrize("warmup,total", [(0, 50), (5, 50), (10, 11)])
def test_without_a_budget_it_is_transformers_cosine(warmup, total):
    ours, theirs = _optimizer(), _optimizer()
    expected = _rates(get_cosine_schedule_with_warmup(theirs, warmup, total), theirs, total)
    got = _rates(cosine_schedule(ours, warmup, total, None), ours, total + 3)
    assert got[:total] == pytest.approx(expected, abs=1e-12)
    assert got[total:] == [0.0] * 3  # past its steps it stays at zero (transformers' would rise again)


def test_a_budget_that_ends_first_ends_the_cosine_with_it():
    """1000 steps planned, a budget spent a tenth per step: the rate follows the budget's share, reaches zero
    as the budget runs out, and never goes back up."""
    optimizer, budget = _optimizer(), TimeBudget(10.0)
    budget.begin(0.0)
    scheduler = cosine_schedule(optimizer, 2, 1000, budget)
    rates = _rates(scheduler, optimizer, 12, lambda step: budget.read(ONE_PROCESS, step + 1.0))
    assert rates[0] == pytest.approx(2.0 * min(1 / 2, 0.5 * (1 + math.cos(math.pi * 0.0))))  # the ramp
    assert rates[3] == pytest.approx(2.0 * 0.5 * (1 + math.cos(math.pi * 0.3)))  # read after step 2: 3 s of 10
    assert all(a >= b for a, b in zip(rates[1:], rates[2:]))
    assert rates[9] > 0.0 and rates[10] == rates[11] == 0.0  # the budget read after step 9 is spent


def test_a_budget_longer_than_the_steps_changes_nothing():
    ours, theirs = _optimizer(), _optimizer()
    budget = TimeBudget(1e6)
    budget.begin(0.0)
    expected = _rates(get_cosine_schedule_with_warmup(theirs, 3, 40), theirs, 40)
    got = _rates(cosine_schedule(ours, 3, 40, budget), ours, 40, lambda step: budget.read(ONE_PROCESS, float(step)))
    assert got == pytest.approx(expected, rel=1e-9)
