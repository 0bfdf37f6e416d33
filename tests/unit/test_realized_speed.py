"""Speculation is judged by what its steady steps yielded, not only by what the plans predicted
(`serve.speculation.realized`): where the cost model prices speculative steps wrong and nothing in it
corrects that, the policy still ends up decoding plainly instead of losing on every step it drafts."""

from __future__ import annotations

import numpy as np
import pytest

from draftsmith.serve import LLM, SamplingParams
from draftsmith.serve.engine.step_accounting import COLD_STEPS, StepLedger
from draftsmith.serve.speculation.adaptive import REPRICE_STEPS, AdaptivePolicy
from draftsmith.serve.speculation.cost_model import FIRST_REPRICE, REPRICE_AFTER, CostModel
from draftsmith.serve.speculation.realized import RealizedSpeed
from helpers import DEMO_MODEL, make_speculation_pay, synthetic_table

K = 4
CURVE = np.array([0.7, 0.8, 0.8, 0.8])  # conditional acceptance by draft position


def _steps_at(speed: float, steps: int, rng, realized: RealizedSpeed | None = None) -> RealizedSpeed:
    """`steps` one-row steps of equal seconds whose tokens/s average `speed` x a plain step's (1 s a token): as
    a one-layer head's, their tokens vary from 1 to 3 (a step's speed by about 0.4 of the mean)."""
    realized = realized or RealizedSpeed()
    for _ in range(steps):
        realized.observe(1, int(rng.integers(1, 4)), 2.0 / speed, 1.0)
    return realized


def test_a_clear_loss_is_a_verdict_and_a_clear_win_is_not():
    rng = np.random.default_rng(0)
    assert not RealizedSpeed().loses(1)  # nothing seen: no verdict
    assert not _steps_at(0.5, 3, rng).loses(1)  # too few steps
    losing = _steps_at(0.7, 20, rng)
    assert losing.loses(1) and losing.ratio(1) == pytest.approx(0.7, abs=0.1)
    assert not losing.loses(8)  # another batch size has its own evidence
    assert not _steps_at(1.3, 40, rng).loses(1)


def test_one_stalled_step_is_no_verdict():
    """A step 50x as long as the rest (the OS, a first-touch allocation) among steps that win 20%."""
    realized = _steps_at(1.2, 30, np.random.default_rng(2))
    realized.observe(1, 2, 100.0, 1.0)
    assert not realized.loses(1)


def test_a_verdict_lasts_until_its_evidence_fades_then_returns_with_new_losses():
    rng = np.random.default_rng(1)
    realized = _steps_at(0.8, 40, rng)
    assert realized.loses(1)
    before = realized.ratio(1)
    realized.idle(130)
    assert realized.ratio(1) == pytest.approx(before)  # fading keeps the mean...
    assert realized.loses(1)  # ... and, while the mean is LIFT_Z errors under plain decoding's, the verdict
    fresh = _steps_at(0.8, 40, np.random.default_rng(1))
    fresh.idle(130)
    assert not fresh.loses(1)  # the same evidence is too thin to give the verdict anew (ARM_Z)
    realized.idle(600)
    assert not realized.loses(1)  # hundreds of plain steps on: tried again
    _steps_at(0.8, 40, rng, realized)
    assert realized.loses(1)  # and losing steps renew it


def test_even_a_clear_loss_is_retried_after_some_hundreds_of_plain_steps():
    """A verdict's error widens as its evidence fades, however clear the loss: one given against a stale plain
    price (the machine slowed while every step speculated) must not hold plain decoding for good. Steps at
    half plain decoding's speed, spread about 0.2: lifted at a weight of about (0.2 / 0.5)^2, some 500 plain
    steps on (it took over 2000 while the error stopped widening at a weight of 2)."""
    realized = _steps_at(0.5, 40, np.random.default_rng(3))
    assert realized.loses(1)
    realized.idle(300)
    assert realized.loses(1)  # a clear loss is not retried soon
    realized.idle(400)
    assert not realized.loses(1)


def _run(table, true_query_cost: float, rows: int, steps: int = 400, seed: int = 0) -> list[float]:
    """Steps driven as the engine drives them, the policy's cost model priced by `table` (live scaling off,
    so only the realized check can see that verifying really costs `true_query_cost` of a decode per
    further token), each speculative step's tokens and true seconds booked as the step ledger books them.
    -> each step's tokens/s over plain decoding's."""
    cost = CostModel(table, per_token_drafts=True, drafts_before_plan=False)
    cost.live_scaling = False
    policy = AdaptivePolicy(K, rows, cost)
    policy.confidence_floor = False
    rng = np.random.default_rng(seed)
    slots, limits, speeds = tuple(range(rows)), [K] * rows, []
    decode = table.estimate(rows, 1)
    for _ in range(steps):
        width = 0 if policy.held(slots) else policy.plan(slots, limits).width
        if not width:
            policy.idle(slots)
            speeds.append(1.0)
            continue
        policy.record(limits, width)
        accepted = (rng.random((rows, width)) < CURVE[:width]).cumprod(1).sum(1)
        policy.observe(list(slots), [width] * rows, accepted.tolist())
        drafting = decode * 0.3 * width
        cost.observe_draft(rows, width, drafting)
        seconds = decode * (1 + true_query_cost * width) + drafting
        tokens = int(rows + accepted.sum())
        cost.observe_yield(rows, tokens, seconds)
        speeds.append(tokens / seconds * decode / rows)
    return speeds


@pytest.mark.parametrize("rows", [1, 8])
def test_speculation_that_loses_against_its_prices_ends_up_plain(rows, monkeypatch):
    """The table says a further verified token costs 0.05 of a decode; it costs 1.0, so every width loses
    (one draft: 1.7 tokens in 2.3 decodes' seconds; 0.5-0.74x plain decoding's speed at every width)."""
    speeds = _run(synthetic_table(0.05), true_query_cost=1.0, rows=rows)
    assert np.mean(speeds[200:]) >= 0.94  # plain but for probes, a few of which lose
    # the premise: the plans alone never see it
    monkeypatch.setattr(RealizedSpeed, "loses", lambda self, rows: False)
    assert np.mean(_run(synthetic_table(0.05), true_query_cost=1.0, rows=rows)[200:]) < 0.7


@pytest.mark.parametrize("rows", [1, 8])
def test_speculation_that_pays_is_not_stopped(rows):
    """Priced right (a further verified token 0.1 of a decode), the best width pays 1.26x plain decoding."""
    speeds = _run(synthetic_table(0.1), true_query_cost=0.1, rows=rows)
    assert np.mean(speeds[200:]) >= 1.15
    assert all(speed != 1.0 for speed in speeds[200:])  # not one plain step


def test_the_engine_books_each_speculative_steps_tokens_and_seconds():
    """The step ledger hands the check what each steady speculative step gave: against plain steps priced
    at a second a token, steps of milliseconds judge speculation many times as fast."""
    config = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    llm = LLM(DEMO_MODEL, dtype="float32", device="cpu", max_num_seqs=1, max_model_len=256, speculative_config=config)
    make_speculation_pay(llm)
    realized = llm.engine.policy.cost.realized
    assert realized.ratio(1) is None
    llm.generate(["x = 1\ny = 2\nz = 3\nx = 1\ny = 2\nz = "], SamplingParams(temperature=0, max_tokens=48),
                 use_tqdm=False)
    assert llm.get_metrics()["num_drafts"] > 0
    assert realized.ratio(1) > 3 and not realized.loses(1)  # steps of milliseconds, or tens on a busy machine


class _Drafted:
    def __init__(self, steady: bool):
        self.forwards, self.steady = 2, steady


class _YieldsSeen(CostModel):
    """A cost model that keeps what the ledger hands the realized check."""

    def __init__(self):
        super().__init__(synthetic_table(0.1), per_token_drafts=True, drafts_before_plan=False)
        self.yields: list[tuple] = []

    def observe_yield(self, rows, tokens, seconds):
        self.yields.append((rows, tokens, seconds))


def test_the_ledger_judges_steady_speculative_steps_by_their_tokens_and_whole_seconds():
    cost, ledger = _YieldsSeen(), StepLedger()
    for _ in range(COLD_STEPS["speculative"]):  # cold: not judged
        ledger.book(2, 3, 0.010, 0.002, 0.006, 0.001, cost, _Drafted(True), tokens=5)
    ledger.book(2, 3, 0.012, 0.004, 0.006, 0.001, cost, _Drafted(False), (1, 3), tokens=4)  # a catch-up
    ledger.book(2, 0, 0.005, 0.0, 0.004, 0.001, cost)  # plain
    ledger.book(2, 3, 0.011, 0.002, 0.006, 0.001, cost, _Drafted(True), tokens=6)
    assert cost.yields == [(2, 6, 0.011)]


def _always_speculating(steps: int) -> tuple[list[int], CostModel]:
    """8 rows whose plans always draft (verifying priced free, every draft accepted), booked through the step
    ledger as the engine books them: plain steps of 10 ms, speculative ones of 12 ms. -> (widths, cost model)"""
    cost = CostModel(synthetic_table(0.0), per_token_drafts=False, drafts_before_plan=False)
    policy, ledger = AdaptivePolicy(K, 8, cost), StepLedger()
    policy.confidence_floor = False
    slots, limits, widths = tuple(range(8)), [K] * 8, []
    for _ in range(steps):
        width = 0 if policy.held(slots) else policy.plan(slots, limits).width
        if width:
            policy.record(limits, width)
            policy.observe(list(slots), [width] * 8, [width] * 8)
            ledger.book(8, width, 0.012, 0.001, 0.010, 0.0005, cost, _Drafted(True), query_len=width + 1,
                        tokens=8 * (width + 1))
        else:
            ledger.book(8, 0, 0.010, 0.0, 0.009, 0.0005, cost)
        widths.append(width)
    return widths, cost


def _plain_runs(widths: list[int]) -> list[tuple[int, int]]:
    """(first step, length) of each run of plain steps."""
    runs, start = [], None
    for step, width in enumerate([*widths, 1]):
        if width == 0 and start is None:
            start = step
        elif width and start is not None:
            runs.append((start, step - start))
            start = None
    return runs


def test_a_batch_size_that_always_speculates_still_has_its_plain_price_taken(monkeypatch):
    """Speculative steps are judged against plain decoding's price at their batch size, which only settled
    plain steps teach. Where every plan drafts, that price was never taken and nothing was judged: a draft
    model ran 0.89x plain decoding at 8 in flight on 0 plain steps. So a batch size decodes plainly for
    REPRICE_STEPS steps after FIRST_REPRICE speculative steps without a plain price, and again after
    REPRICE_AFTER with a stale one."""
    widths, cost = _always_speculating(700)
    runs = _plain_runs(widths)
    assert [length for _, length in runs] == [REPRICE_STEPS] * len(runs)
    assert runs[0][0] <= FIRST_REPRICE + 8  # after the cold steps the ledger does not book
    assert [b - a for (a, _), (b, _) in zip(runs, runs[1:])] == [REPRICE_AFTER + REPRICE_STEPS] * (len(runs) - 1)
    assert cost.forward_scales.measured(8) and cost.realized.ratio(8) > 1
    # the premise: without it, no step is plain and nothing is judged
    monkeypatch.setattr(CostModel, "plain_stale", lambda self, rows: False)
    widths, cost = _always_speculating(700)
    assert 0 not in widths and cost.realized.ratio(8) is None
