"""Adaptive speculation: the goals the policy meets, simulated on synthetic cost tables and acceptance rates
(never much slower than plain decoding; speculating where it pays, not where it loses; resuming when it pays
again), the invariants of its plans, and lossless decoding (greedy: token for token; sampled: in
distribution) whatever width each step takes. The cost model's own tests are in test_cost_model.py."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch

from draftsmith.methods import method_names, resolve_method, servable
from draftsmith.models import load_target
from draftsmith.models.heads import DraftHeadConfig
from draftsmith.serve import LLM, SamplingParams
from draftsmith.serve.engine.outputs import OutputCollector
from draftsmith.serve.speculation import adaptive
from draftsmith.serve.speculation.adaptive import PROBE_WORST, THIN_EVIDENCE, AdaptivePolicy, probe_worst
from draftsmith.serve.speculation.cost_model import CostModel
from draftsmith.serve.speculation.estimators import AcceptanceStats
from helpers import (
    DEMO_MODEL,
    REPO,
    dspark_head,
    peagle_head,
    random_mlp_speculator,
    spec_config,
    synthetic_table,
)

PROMPTS = [
    "x = 1\ny = 2\nz = 3\nx = 1\ny = ",
    "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a",
    "class Node:\n    def __init__(self, value, children=None):\n        self.value = value\n        self.children = chi",
    "for i in range(10):\n    print(i)\nfor i in range(10):\n    print(",
    "import os\nimport sys\nimport os\nimport ",
]
GREEDY = SamplingParams(temperature=0, max_tokens=40)


EXPENSIVE, CHEAP = synthetic_table(2.0, unit=0.05), synthetic_table(0.0)
# What speculating may cost against plain decoding, at worst, over a simulated run: the steps that learn that
# drafts are rejected, and the probes that check again later (6% in the worst case below)
LOSS_MARGIN = 0.08
K = 4


def _policy(table, k=K, sequential=False, num_slots=8) -> AdaptivePolicy:
    cost = CostModel(table, per_token_drafts=sequential, drafts_before_plan=not sequential)
    return AdaptivePolicy(k, num_slots=num_slots, cost=cost)


def _feed(policy, slots, accepted_each: int, times: int = 10):
    slots = torch.tensor(slots)
    for _ in range(times):
        policy.observe(slots, torch.full((len(slots),), policy.k), torch.full((len(slots),), accepted_each))


@dataclass(frozen=True)
class Run:
    """A simulated run: its tokens/s over plain decoding's, each step's width, the steps that asked `plan`."""

    speedup: float
    widths: list[int]
    plans: int
    metrics: dict

    def speculating(self, start: int = 0, stop: int | None = None) -> float:
        """The share of steps start..stop that drafted."""
        return float(np.mean(np.array(self.widths[start:stop]) > 0))


def _simulate(query_cost: float, rows: int, acceptance, steps: int = 300, sequential: bool = True,
              catch_up_cap: int = 0, seed: int = 0) -> Run:
    """`steps` decode steps of `rows` rows driven through an adaptive policy as the engine drives it (held, or
    planned, recorded, then observed or idle), on `synthetic_table(query_cost)`, each draft accepted with
    probability `acceptance(step)` (or the float) when the drafts before it were. The policy's cost model
    prices steps as they really cost (no live timings): what is tested is how it decides. With `catch_up_cap`,
    a row resuming must first feed the draft model the positions it missed, up to that many (as an EAGLE head
    kept by reference), and its plan is told so."""
    table = synthetic_table(query_cost)
    policy = AdaptivePolicy(K, rows, CostModel(table, per_token_drafts=sequential, drafts_before_plan=False))
    policy.cost.live_scaling = False
    truth = CostModel(table, per_token_drafts=sequential, drafts_before_plan=False)
    rng = np.random.default_rng(seed)
    slots, limits = tuple(range(rows)), [K] * rows
    tokens = seconds = 0.0
    widths, plans, missed = [], 0, 0
    for step in range(steps):
        rate = acceptance(step) if callable(acceptance) else acceptance
        width = 0
        if not policy.held(slots):
            plans += 1
            catch_up = (rows, min(missed, catch_up_cap)) if missed and catch_up_cap else (0, 0)
            width = policy.plan(slots, limits, catch_up).width
            policy.record(limits, width)
            if width:
                accepted = (rng.random((rows, width)) < rate).cumprod(1).sum(1)
                policy.observe(list(slots), [width] * rows, accepted.tolist())
                tokens += accepted.sum()
            else:
                policy.idle(slots)
        missed = 0 if width else missed + 1
        tokens += rows
        seconds += truth.step_seconds(rows, width)
        widths.append(width)
    return Run(tokens / seconds / (rows / truth.step_seconds(rows, 0)), widths, plans, policy.metrics())


@pytest.mark.parametrize("sequential", [True, False], ids=["sequential", "one-forward"])
@pytest.mark.parametrize("acceptance", [0.05, 0.5, 0.9])
@pytest.mark.parametrize("rows", [1, 8])
@pytest.mark.parametrize("query_cost", [0.0, 0.3, 0.9], ids=["free-verify", "cheap-verify", "dear-verify"])
def test_speculating_is_never_much_slower_than_plain_decoding(query_cost, rows, acceptance, sequential):
    run = _simulate(query_cost, rows, acceptance, sequential=sequential)
    assert run.speedup >= 1 - LOSS_MARGIN, run
    # every step's rows are counted once, held steps too, each within 0..k
    assert sum(run.metrics["spec_k_histogram"]) == rows * len(run.widths)
    assert run.metrics["num_steps_without_speculation"] == run.widths.count(0)
    assert all(0 <= w <= K for w in run.widths)


@pytest.mark.parametrize("sequential", [True, False], ids=["sequential", "one-forward"])
@pytest.mark.parametrize("rows", [1, 8])
def test_it_speculates_where_verifying_is_free_and_drafts_are_accepted(rows, sequential):
    run = _simulate(0.0, rows, 0.9, sequential=sequential)
    assert run.speculating() > 0.95 and run.speedup > 1.5


@pytest.mark.parametrize("rows", [1, 8])
def test_it_stops_speculating_and_planning_where_drafts_are_rejected_and_verifying_is_dear(rows):
    """Mostly plain steps, and few of them planned: a plan that says plain holds for a while (planning a large
    batch costs time too)."""
    run = _simulate(0.9, rows, 0.02)
    assert run.speculating() < 0.1 and run.plans < 0.25 * len(run.widths)


@pytest.mark.parametrize("rows,query_cost", [(1, 0.0), (1, 0.3), (8, 0.0)])
def test_it_resumes_speculating_after_acceptance_recovers(rows, query_cost):
    """Plain steps teach nothing about drafting: only probes find that drafts are accepted again."""
    run = _simulate(query_cost, rows, lambda step: 0.0 if step < 150 else 0.9, steps=600)
    assert run.speculating(50, 150) < 0.2 and run.speculating(500) > 0.8


def test_a_few_first_rejections_do_not_keep_speculation_off_for_good():
    """Two rejected drafts (an engine's first request, its prompt cut mid-word) leave too little evidence to
    stop probing; the same rejections THIN_EVIDENCE times over are believed: no probe, where speculating at
    the rates they leave is predicted far slower than plain decoding."""
    slots, limits = torch.tensor([0]), torch.tensor([K])
    thin, believed = (_policy(synthetic_table(0.9), sequential=True) for _ in range(2))
    _feed(thin, [0], accepted_each=0, times=2)
    _feed(believed, [0], accepted_each=0, times=THIN_EVIDENCE)
    assert any(_widths(thin, slots, limits, 100)) and not any(_widths(believed, slots, limits, 300))


def _widths(policy, slots, limits, steps: int) -> list[int]:
    """Each step's width as the engine runs it: 0 while a plan without speculation holds, else a new plan's."""
    return [0 if policy.held(tuple(slots.tolist())) else policy.plan(slots, limits).width for _ in range(steps)]


def test_plans_stay_within_0_k_and_each_rows_limit():
    policy, rng = _policy(CHEAP), np.random.default_rng(0)
    for _ in range(200):
        rows = int(rng.integers(1, 9))
        slots, limits = np.arange(rows), rng.integers(0, K + 1, rows)
        _feed(policy, slots.tolist(), accepted_each=int(rng.integers(0, K + 1)), times=1)
        width = 0 if policy.held(tuple(slots.tolist())) else policy.plan(slots, limits).width
        assert 0 <= width <= limits.max()


def test_widths_kept_per_limits_are_each_rows_own(monkeypatch):
    """What a plan prices for each width comes from the limits it was given: each row's cap min(limit, k) and
    the rows' mean verified tokens 1 + mean(min(width, cap)), kept per limits and within WIDTHS_KEPT of them."""
    monkeypatch.setattr(adaptive, "WIDTHS_KEPT", 8)
    policy, rng = _policy(CHEAP), np.random.default_rng(1)
    for _ in range(100):
        limits = rng.integers(0, K + 3, int(rng.integers(1, 9))).tolist()
        caps, query_lens = policy._widths(limits)
        assert list(caps) == [min(n, K) for n in limits]
        drafts = np.minimum(np.arange(K + 1)[None, :], np.array(caps)[:, None])
        np.testing.assert_allclose(query_lens, 1 + drafts.mean(0))
        assert len(policy._widths_by_limits) <= 8


def test_a_step_short_of_drafts_holds_only_where_drafting_rarely_pays(monkeypatch):
    """n-gram drafts before the plan: a step where one row of 8 found a match decodes plainly, but says nothing
    about the next step, so it is not held where rows usually find drafts; where they rarely do (and a
    typical step would lose), it is."""
    slots = torch.arange(8)
    everyone, one_row = torch.full((8,), 4), torch.tensor([4] + [0] * 7)
    for usual, held in ((everyone, False), (one_row, True)):
        policy = _policy(CHEAP)
        _feed(policy, list(range(8)), accepted_each=4)
        # plain: 1 s; a speculative step: 1 s of overhead plus 0.5 s per mean verified token per row, so all
        # rows drafting 4 (40 tokens in 3.5 s) beats plain (8 in 1 s) and one row alone (12 in 1.75 s) does not
        prices = lambda rows, query_lens, *args: [1.0] + [1.0 + 0.5 * q for q in query_lens[1:]]  # noqa: E731
        monkeypatch.setattr(policy.cost, "step_seconds_by_width", prices)
        for _ in range(30):
            policy.plan(slots, usual)
        assert policy.plan(slots, one_row).width == 0
        assert policy.held(tuple(slots.tolist())) == held



@pytest.mark.parametrize("room", [0, 1])
def test_a_plan_made_plain_by_the_rows_room_alone_holds_nothing(monkeypatch, room):
    """A request a token or two from its max_tokens has room for fewer drafts than pay: its plan is plain, but
    says nothing about speculating, so the next request (at one in flight, the same slot) is planned afresh
    at its first step rather than held plainly as after a loss. A plan that would be plain with room for k
    drafts too holds as before."""
    # plain: 1 s; a speculative step: 2.5 s whatever its width (a parallel drafter), so that one draft loses
    # clearly however well it is accepted, and four accepted drafts win
    prices = lambda rows, query_lens, *args: [1.0] + [2.5] * (len(query_lens) - 1)  # noqa: E731
    slots = torch.tensor([0])
    for accepted, held in ((K, False), (0, True)):
        policy = _policy(CHEAP, sequential=True)
        monkeypatch.setattr(policy.cost, "step_seconds_by_width", prices)
        _feed(policy, [0], accepted_each=accepted, times=THIN_EVIDENCE)
        assert policy.plan(slots, torch.tensor([room])).width == 0
        assert policy.held((0,)) == held
        policy.admit(0)
        assert policy.held((0,)) == held  # a hold after a loss goes on for the next request
        if not held:
            assert policy.plan(slots, torch.tensor([K])).width > 0


def _close_call(query_cost: float, rejections: int) -> AdaptivePolicy:
    """A policy whose method drafts well (slots 1-3) and whose slot 0 just had `rejections` steps rejected."""
    policy = _policy(synthetic_table(query_cost), sequential=True)
    _feed(policy, [1, 2, 3], accepted_each=2, times=THIN_EVIDENCE)
    _feed(policy, [0], accepted_each=0, times=rejections)
    return policy


@pytest.mark.parametrize("query_cost,rejections", [(0.25, 6), (0.25, 8), (0.3, 6)])
def test_a_close_call_holds_until_fading_could_make_a_plan_speculate(query_cost, rejections):
    """A lone request's close call is re-planned at the step where a policy planning every step would first
    speculate again (its evidence fading with each plain step), not before (held steps bring no evidence: a
    plan then says the same at a price) and not after (speculation would be off where it pays)."""
    from draftsmith.serve.speculation.adaptive import CLOSE_CALL

    slots, limits = torch.tensor([0]), torch.tensor([K])
    holder, replanner = _close_call(query_cost, rejections), _close_call(query_cost, rejections)
    assert holder.plan(slots, limits).width == 0 and holder._close_calls == 1  # a close call
    holder.idle(slots)  # the planned step runs plainly, as the engine books it
    held = 0
    while holder.held((0,)):
        held += 1
    widths = []
    while not widths or widths[-1] == 0:
        plan = replanner.plan(slots, limits)
        replanner.idle(slots)
        replanner._hold = 0  # asked every step
        widths.append(plan.width)
    assert held + 1 == len(widths) - 1 >= 2, (held, widths, CLOSE_CALL)
    assert holder.plan(slots, limits).width > 0


def test_a_close_call_fading_cannot_change_holds_until_a_probe_is_due(monkeypatch):
    """Where the method's own rates make speculating a close call, fading changes nothing: one request holds
    until a probe is due, so plans are few (each one costs host time), and the plan then probes."""
    policy = _policy(CHEAP, sequential=True)
    _feed(policy, [0, 1, 2, 3], accepted_each=1, times=THIN_EVIDENCE)
    # plain: 1 s; drafting w: 1 s + 1.05 s per draft, so one draft accepted nearly always yields ~0.95x plain
    prices = lambda rows, query_lens, *args: [1.0] + [1.0 + 1.05 * w for w in range(1, len(query_lens))]  # noqa: E731
    monkeypatch.setattr(policy.cost, "step_seconds_by_width", prices)
    slots, limits = torch.tensor([0]), torch.tensor([K])
    assert policy.plan(slots, limits).width == 0 and policy._close_calls == 1
    policy.idle(slots)
    held = 0
    while policy.held((0,)):
        held += 1
    assert held >= 8 and policy.plan(slots, limits).width > 0  # the due probe


def test_a_close_call_hold_ends_when_a_new_request_takes_the_slot():
    """The hold was timed by the last request's evidence; the new one starts from the method's rates."""
    policy, slots, limits = _close_call(0.25, 8), torch.tensor([0]), torch.tensor([K])
    assert policy.plan(slots, limits).width == 0 and policy.held((0,))
    policy.admit(0)
    assert not policy.held((0,)) and policy.plan(slots, limits).width > 0


def test_an_overdue_probe_not_worth_its_catch_up_does_not_shorten_holds(monkeypatch):
    """A probe is judged with its whole catch-up (`_explore`); where it would not run, its being due must not
    cap the holds after clear losses (they stayed at PLAIN_HOLD for good: a plan every 8 steps, where plans
    are re-asked only to say the same)."""
    from draftsmith.serve.speculation.adaptive import MAX_PLAIN_HOLD

    policy = _policy(CHEAP, sequential=True)
    _feed(policy, [0], accepted_each=1, times=THIN_EVIDENCE)
    # plain: 1 s; drafting w: 1 s + 1.5 s per draft: one draft accepted nearly always yields ~0.78x plain,
    # a clear loss, but worth a probe but for the catch-up's 100 s
    prices = lambda rows, query_lens, *args: [1.0] + [1.0 + 1.5 * w for w in range(1, len(query_lens))]  # noqa: E731
    monkeypatch.setattr(policy.cost, "step_seconds_by_width", prices)
    monkeypatch.setattr(policy.cost, "catch_up", lambda rows, positions: 100.0)
    slots, limits, plans, steps = torch.tensor([0]), torch.tensor([K]), 0, 1200
    for _ in range(steps):
        if not policy.held((0,)):
            plans += 1
            assert policy.plan(slots, limits, catch_up=(1, 50)).width == 0
            policy.idle(slots)
    assert plans <= steps / MAX_PLAIN_HOLD + 5


@pytest.mark.parametrize("first_feed", [False, True])
def test_a_probe_counts_a_first_feed_spread_and_any_other_catch_up_whole(monkeypatch, first_feed):
    """A probe's catch-up counts whole (`_explore`), but a first feed (`unfed` rows: the drafter holds none of
    their positions) serves the request's later drafts and stays spread as the plan prices it: counted whole, a
    DFlash head holding new prompts unfed never probed again. Prices as in the test above: a loss, but within
    PROBE_WORST but for the catch-up."""
    policy = _policy(CHEAP, sequential=True)
    _feed(policy, [0], accepted_each=1, times=THIN_EVIDENCE)
    prices = lambda rows, query_lens, *args: [1.0] + [1.0 + 1.5 * w for w in range(1, len(query_lens))]  # noqa: E731
    monkeypatch.setattr(policy.cost, "step_seconds_by_width", prices)
    monkeypatch.setattr(policy.cost, "catch_up", lambda rows, positions: 100.0)
    slots, limits, unfed = torch.tensor([0]), torch.tensor([K]), ((0, 128),) if first_feed else ()
    probes = 0
    for _ in range(600):
        if not policy.held((0,)):
            width = policy.plan(slots, limits, catch_up=(1, 500), unfed=unfed).width
            probes += width > 0
            policy.idle(slots)
    assert (probes > 0) == first_feed


@pytest.mark.parametrize("rows", [1, 8])
def test_a_probe_must_come_nearer_plain_decoding_the_more_rows_it_drafts_for(monkeypatch, rows):
    """A probe pays only where the rows' acceptance turns out above the plan's estimate, and a batch's mean
    strays from it as 1/sqrt(rows): predicted at 0.8x plain decoding at best, one row probes (PROBE_WORST, 0.7)
    and eight rows never do (`probe_worst(8)`, 0.89)."""
    assert probe_worst(1) == PROBE_WORST and probe_worst(8) == pytest.approx(1 - (1 - PROBE_WORST) / 8**0.5)
    policy = _policy(CHEAP, sequential=True)
    slots = list(range(rows))
    _feed(policy, slots, accepted_each=1, times=THIN_EVIDENCE)
    # plain: a token a row in 1 s; the first draft is nearly always accepted and the second nearly never, so
    # one draft gives under 2 tokens a row in 2.5 s (0.8x), and each further one costs 1.5 s more
    prices = lambda rows, query_lens, *args: [1.0] + [1.0 + 1.5 * w for w in range(1, len(query_lens))]  # noqa: E731
    monkeypatch.setattr(policy.cost, "step_seconds_by_width", prices)
    probes = 0
    for _ in range(600):
        if not policy.held(tuple(slots)):
            probes += policy.plan(torch.tensor(slots), torch.tensor([K] * rows)).width > 0
            policy.idle(slots)
    assert (probes > 0) == (rows == 1)


def test_close_calls_after_drafting_hold_longer_in_a_row_up_to_a_cap(monkeypatch):
    """Proposers that draft before the plan: a close call holds one request CLOSE_HOLD steps; each close
    call in a row doubles that, up to MAX_DRAFTED_CLOSE_HOLD; a plan that speculates starts the count again."""
    from draftsmith.serve.speculation.adaptive import CLOSE_HOLD, MAX_DRAFTED_CLOSE_HOLD
    from draftsmith.serve.speculation.plan import StepPlan

    policy = _policy(CHEAP, sequential=False)
    _feed(policy, [0], accepted_each=2, times=THIN_EVIDENCE)  # evidence enough: no probe is judged apart
    plain, close = StepPlan(0, 0.0, 1.0, 1.0), StepPlan(2, 0.0, 0.95, 1.0)  # speculating: 0.95x plain's speed
    outcome = {"best": plain}
    monkeypatch.setattr(policy, "_choose", lambda *args: (None, outcome["best"], close, plain))
    monkeypatch.setattr(policy, "_typical_ratio", lambda *args: 0.95)
    slots, limits = torch.tensor([0]), torch.tensor([4])

    def steps_held_after_a_plan() -> int:
        assert policy.plan(slots, limits).width == outcome["best"].width
        held = 0
        while policy.held((0,)):
            held += 1
        return held

    assert [steps_held_after_a_plan() for _ in range(4)] == [
        CLOSE_HOLD - 1, 2 * CLOSE_HOLD - 1, MAX_DRAFTED_CLOSE_HOLD - 1, MAX_DRAFTED_CLOSE_HOLD - 1]
    outcome["best"] = close  # a plan that speculates
    assert steps_held_after_a_plan() == 0
    outcome["best"] = plain
    assert steps_held_after_a_plan() == CLOSE_HOLD - 1


def test_held_steps_fade_evidence_as_plain_steps_do():
    held, stepped = _policy(EXPENSIVE), _policy(EXPENSIVE)
    slots, limits = torch.tensor([0, 1]), torch.tensor([4, 4])
    for policy in (held, stepped):
        _feed(policy, [0, 1], accepted_each=0)
        assert policy.plan(slots, limits).width == 0
    while held.held((0, 1)):
        stepped.acceptance.idle(slots)  # what a plain step that re-plans does
    held.plan(slots, limits)  # applies the held steps' fading in one go
    torch.testing.assert_close(held.acceptance.rates(slots), stepped.acceptance.rates(slots))
    assert not np.array_equal(held.acceptance.rates(slots), _fed_rates(slots))


def test_planned_plain_steps_fade_evidence_at_the_next_plan():
    """policy.idle (a plan said plain) defers its fading to the next plan, where it equals fading each step."""
    lazy, eager = _policy(EXPENSIVE), _policy(EXPENSIVE)
    slots, limits = torch.tensor([0, 1]), torch.tensor([4, 4])
    for policy in (lazy, eager):
        _feed(policy, [0, 1], accepted_each=0)
    for _ in range(5):
        lazy.idle(slots)
        eager.acceptance.idle(slots)
        eager.cost.idle()
    assert np.array_equal(lazy.acceptance.rates(slots), _fed_rates(slots))  # not yet applied
    lazy.plan(slots, limits)
    torch.testing.assert_close(lazy.acceptance.rates(slots), eager.acceptance.rates(slots))
    assert lazy.cost.catch_up_weight == eager.cost.catch_up_weight


def _random_history(stats: AcceptanceStats, steps: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        if rng.random() < 0.6:
            drafted = rng.integers(0, stats.k + 1, 3)
            stats.observe([0, 1, 2], drafted, np.minimum(rng.integers(0, stats.k + 1, 3), drafted))
        else:
            stats.idle([0, 2], int(rng.integers(1, 5)))


def test_rates_after_idle_steps_are_the_rates_once_those_steps_faded():
    """`rates(slots, idle_steps)` (what a close call's hold is timed by) in closed form equals fading step by
    step."""
    import copy

    stats = AcceptanceStats(4, 5)
    _random_history(stats, 60, seed=1)
    for steps in (1, 3, 7, 16):
        faded = copy.deepcopy(stats)
        faded.idle([2, 0], steps)
        predicted = stats.rates([2, 0], idle_steps=steps)
        assert np.array(predicted).shape == (2, 5)
        np.testing.assert_allclose(predicted, faded.rates([2, 0]), rtol=1e-12)
        assert not np.allclose(predicted, stats.rates([2, 0]))


def _fed_rates(slots):
    fresh = _policy(EXPENSIVE)
    _feed(fresh, [0, 1], accepted_each=0)
    return fresh.acceptance.rates(slots)



def test_rows_without_drafts_cost_only_their_own_token():
    """The verify forward is packed: one row drafting among eight costs its drafts, not eight rows' worth.
    With each verified token a fifth of a decode, one row drafting 3 at 90% acceptance pays; priced as if every
    row verified 4 tokens it would not."""
    policy = _policy(synthetic_table(0.2))
    slots = torch.arange(8)
    _feed(policy, [0], accepted_each=4, times=20)
    limits = torch.tensor([3, 0, 0, 0, 0, 0, 0, 0])
    plan = policy.plan(slots, limits)
    assert plan.width == 3
    padded = policy.cost.step_seconds(8, 3)
    assert plan.expected_seconds < 0.7 * padded and plan.expected_tokens / padded < 8 / policy.cost.step_seconds(8, 0)


def test_sequential_drafting_cost_and_confidence_floor():
    """A proposer that pays per draft step drafts fewer tokens than a free one, and gets a floor > 0."""
    free, paid = _policy(synthetic_table(0.05)), _policy(synthetic_table(0.05), sequential=True)
    paid.cost.observe_draft(1, 1, 0.6e-3)
    for policy in (free, paid):
        _feed(policy, [0], accepted_each=2)  # 0.9-ish at positions 1-2, then 0 at 3
    plan_free, plan_paid = free.plan(torch.tensor([0]), torch.tensor([4])), paid.plan(torch.tensor([0]), torch.tensor([4]))
    assert plan_paid.width <= plan_free.width and plan_paid.width >= 1
    assert plan_free.stop_below == 0.0 < plan_paid.stop_below < 1.0



@pytest.mark.slow
def test_an_engines_first_steps_teach_the_cost_model_nothing():
    """The first steps of each kind run cold; the cost model learns from the steps after COLD_STEPS of them,
    and from plain steps only once SETTLING_STEPS of them in a row have followed a speculative one, one in
    PLAIN_SAMPLE of those."""
    from draftsmith.serve.engine.step_accounting import COLD_STEPS, PLAIN_SAMPLE, SETTLING_STEPS

    llm = LLM(DEMO_MODEL, dtype="float32", device="cpu", max_num_seqs=1, max_model_len=256,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1})
    engine, cost = llm.engine, llm.engine.policy.cost
    cost.table, cost.live_scaling = CHEAP, False  # so that it speculates too
    for learner in ("observe_host", "observe_draft", "observe_yield", "observe_step", "observe_catch_up"):
        setattr(cost, learner, lambda *args, **kwargs: None)  # live timings would make the plans vary by run
    timed, speculated = [], []
    cost.observe_forward = lambda rows, query_len, seconds, decay=0.95: timed.append(query_len)
    account = engine._account
    engine._account = lambda rows, width, *args: speculated.append(width > 0) or account(rows, width, *args)
    llm.generate(PROMPTS[1:], SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)  # one at a time
    cold, plain_run, expected, unsettled = dict(COLD_STEPS), SETTLING_STEPS, 0, 0
    for spec in speculated:  # n-gram: no catch-up steps
        kind = "speculative" if spec else "plain"
        plain_run = 0 if spec else plain_run + 1
        if cold[kind]:
            cold[kind] -= 1
        elif spec or (plain_run > SETTLING_STEPS and plain_run % PLAIN_SAMPLE == 0):
            expected += 1
        else:
            unsettled += 1
    assert sum(speculated) > COLD_STEPS["speculative"] and len(speculated) - sum(speculated) > COLD_STEPS["plain"]
    assert len(timed) == expected and unsettled > 0


def test_resuming_after_a_pause_is_priced():
    """Drafting pays for a row with good acceptance; a row that must first feed the draft model 30 positions it
    missed while speculation was off pays for that catch-up (spread over the steps it serves), and does not
    resume when the catch-up is long enough."""
    policy = _policy(synthetic_table(0.3), sequential=True)
    _feed(policy, [0], accepted_each=4)
    slots, limits = torch.tensor([0]), torch.tensor([4])
    steady, resuming = policy.plan(slots, limits), policy.plan(slots, limits, catch_up=(1, 30))
    assert steady.width == resuming.width == 4
    assert resuming.expected_seconds > steady.expected_seconds
    assert policy.plan(slots, limits, catch_up=(1, 400)).width == 0
    # the catch-up is a forward of its own for the rows that need it: more of them cost more
    many = torch.arange(8)
    _feed(policy, list(range(8)), accepted_each=4)
    one, all_ = (policy.plan(many, torch.full((8,), 4), catch_up=(n, 30)) for n in (1, 8))
    assert all_.expected_seconds > one.expected_seconds


def test_a_new_rows_first_feed_is_priced_over_the_steps_it_serves():
    """A draft model is fed a new request's prompt at its first draft: a catch-up that serves every later draft
    of the request. Spread over the steps the row is expected to take (FIRST_FEED_HORIZON at most), one that a
    resuming row would not pay for (spread over CATCH_UP_HORIZON) pays; a request with few tokens left
    cannot repay it."""
    def plan(catch_up, unfed=(), rows=1):  # each by a policy of its own: a plan's outcome moves the next one's
        policy = _policy(synthetic_table(0.3), sequential=True)
        _feed(policy, list(range(rows)), accepted_each=4)
        return policy.plan(torch.arange(rows), torch.full((rows,), 4), catch_up, unfed)

    prompt = (1, 200)  # a catch-up of 20 ms against steps of 3.5 ms that give 5 tokens (1 ms for 1 plainly)
    assert plan(prompt).width == 0
    assert plan(prompt, unfed=((0, 128),)).width == 4
    assert plan(prompt, unfed=((0, 8),)).width == 0
    assert plan((1, 600), unfed=((0, 10_000),)).width == 0  # spread over FIRST_FEED_HORIZON steps at most
    # one row of 8 brings an eighth of the batch's gain: its prompt is charged 8x as much a step
    alone = plan(prompt, unfed=((0, 128),)).expected_seconds - plan((0, 0)).expected_seconds
    among_8 = plan(prompt, unfed=((0, 128),), rows=8).expected_seconds - plan((0, 0), rows=8).expected_seconds
    assert among_8 == pytest.approx(8 * alone, rel=0.03)  # (the rows' rates, and so their steps, differ a little)


def test_a_head_that_never_pays_is_not_retried_on_fading_evidence_alone():
    """A head whose first draft is accepted 30% of the time never pays at one row; while it is held, its
    evidence fades toward its long-run rates read optimistically, and retrying on that alone, a catch-up priced
    as if the run would last CATCH_UP_HORIZON steps, drafted every hundred-odd steps (32 steps over these three
    seeds). After short runs the next catch-up is priced over a short run's steps (SHORT_RUNS), and what
    retries it is the probe schedule, whose wait doubles."""
    late = [step for seed in range(3)
            for step, width in enumerate(_simulate(0.06, 1, 0.3, 3000, catch_up_cap=58, seed=seed).widths)
            if width and step >= 320]
    assert len(late) <= 4, late


@pytest.mark.parametrize("first_rate,w2_seconds,explores", [(0.8, 1.5, True), (0.2, 1.2, False)])
def test_a_plan_drafts_one_deeper_only_where_drafts_reach_that_deep(first_rate, w2_seconds, explores):
    """With no evidence yet at the position after the best width (a fresh policy), a plan drafts one more to
    measure it, if predicted within EXPLORE_WORST of the best; but not where the rows' first drafts are
    rejected so often that the deeper one is seldom reached (EXPLORE_REACH): that plan measures little and
    costs a wider verify on every step it runs."""
    from draftsmith.serve.speculation.adaptive import EXPLORE_REACH, EXPLORE_WORST

    policy = _policy(CHEAP, sequential=True, num_slots=1)
    rates = [[first_rate] + [0.9] * (K - 1)]
    seconds = [1.0, 1.0, w2_seconds, 4.0, 5.0]  # width 1 pays best, width 2 within EXPLORE_WORST of it
    gain, best, _, _ = policy._choose(rates, (K,), seconds)
    one, two = (1 + gain[0][w] for w in (1, 2))
    assert one / seconds[1] > two / seconds[2] >= EXPLORE_WORST * one / seconds[1]  # only the reach differs
    assert (first_rate >= EXPLORE_REACH) == explores
    assert (best.width, best.explore) == ((2, True) if explores else (1, False))


def test_acceptance_counts_each_position_reached():
    stats = AcceptanceStats(num_slots=3, k=3, decay=1.0)
    stats.observe(torch.tensor([0, 1, 2]), torch.tensor([3, 2, 0]), torch.tensor([1, 2, 0]))
    assert stats.reached.tolist() == [[1, 1, 0], [1, 1, 0], [0, 0, 0]]
    assert stats.accepted.tolist() == [[1, 0, 0], [1, 1, 0], [0, 0, 0]]
    before = stats.rates(torch.tensor([0]))[0][1]
    for _ in range(50):
        stats.idle(torch.tensor([0]))  # old evidence fades back to the method's rate
    after = stats.rates(torch.tensor([0]))[0][1]
    assert before < after


def test_a_poor_method_stays_priced_poor_through_plain_steps_and_is_retried_much_later():
    """While nothing is drafted the method's running rates fade toward its long-run rates, not the first guesses
    (0.7, 0.8): fading to those, a head accepting 20% looked worth speculating with again some 30 plain steps
    on. The long-run rates fade too, far more slowly, so another workload gets its chance."""
    stats = AcceptanceStats(num_slots=2, k=2)
    for _ in range(300):  # drafts 2 a step, 1 in 5 first drafts accepted
        stats.observe([0], [2], [1])
        for _ in range(4):
            stats.observe([0], [2], [0])
    poor = stats.rates([1])[0][0]  # a new request's rate: the method's
    assert poor < 0.3
    stats.idle([0], 60)
    assert stats.rates([1])[0][0] < 0.3  # a first guess of 0.7 would have been back by now
    stats.idle([0], 10_000)
    assert stats.rates([1])[0][0] > 0.6


@pytest.fixture(scope="module")
def reference_ids():
    llm = LLM(DEMO_MODEL, dtype="float32", device="cpu", max_num_seqs=3, max_model_len=256)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.mark.slow
def test_engine_k_falls_to_zero_and_rises_again(reference_ids):
    config = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    llm = LLM(DEMO_MODEL, dtype="float32", device="cpu", max_num_seqs=3, max_model_len=256, speculative_config=config)
    engine = llm.engine
    # the synthetic tables alone price forwards: live timings would correct their shape toward this CPU's
    engine.policy.cost.live_scaling = False
    for table, speculates in ((EXPENSIVE, False), (CHEAP, True), (EXPENSIVE, False)):
        engine.policy.cost.table = table
        engine.reset_metrics()
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)  # 5 prompts on 3 slots: mixed batches
        assert [o.outputs[0].token_ids for o in outputs] == reference_ids
        m = llm.get_metrics()
        decode_steps = m["step_profile"]["decode_steps"]
        if speculates:
            assert m["num_drafts"] > 0 and sum(m["spec_k_histogram"][1:]) > 0
            assert m["num_steps_without_speculation"] < decode_steps
            assert m["num_forward_passes"] < m["num_generated_tokens"]
        else:
            assert m["num_drafts"] == 0 and m["num_steps_without_speculation"] == decode_steps
            assert sum(m["spec_k_histogram"][1:]) == 0


@pytest.mark.slow
def test_eagle_rows_resume_drafting_after_held_steps(reference_ids):
    """Held steps still hand the EAGLE-3 proposer the target's features: when speculation pays again
    mid-request, the head drafts with its context whole, and accepts as often as a run that never paused
    (resuming from a context of a few positions, the demo head accepted almost nothing). Output stays
    greedy-equal."""
    config = SERVABLE_CONFIGS["eagle3"](None) | {"num_speculative_tokens": 3}
    llm = LLM(DEMO_MODEL, dtype="float32", device="cpu", max_num_seqs=3, max_model_len=256, speculative_config=config)
    engine = llm.engine
    engine.policy.cost.live_scaling = False
    engine.policy.confidence_floor = False
    held, is_held = [], engine.policy.held
    engine.policy.held = lambda slots: held.append(is_held(slots)) or held[-1]
    order = {engine.add_request(llm.encode(p)[1], GREEDY).request_id: i for i, p in enumerate(PROMPTS)}
    outputs, step, phases, collector = [None] * len(PROMPTS), 0, [], OutputCollector()
    while engine.has_unfinished_requests():
        if step % 12 == 0:  # alternate: plain (held) stretches, then speculation over the same requests
            engine.policy.cost.table = EXPENSIVE if step % 24 == 0 else CHEAP
            engine.policy._hold = 0  # prices changed under a hold: plan again now (a hold runs up to 64 steps)
            phases.append(dict(engine.spec_metrics.as_dict()))
        for out in collector.add_all(engine.step()):
            if out.finished:
                outputs[order[out.request_id]] = out.outputs[0].token_ids
        step += 1
    phases.append(dict(engine.spec_metrics.as_dict()))
    assert outputs == reference_ids
    assert sum(held) >= 10
    resumed = [(b["num_accepted_tokens"] - a["num_accepted_tokens"], b["num_draft_tokens"] - a["num_draft_tokens"])
               for a, b in zip(phases[1::2], phases[2::2])]  # the cheap stretches, each after a held one
    accepted, drafted = map(sum, zip(*resumed))
    fixed = LLM(DEMO_MODEL, dtype="float32", device="cpu", max_num_seqs=3, max_model_len=256,
                speculative_config=spec_config(**config))
    fixed.generate(PROMPTS, GREEDY, use_tqdm=False)
    m = fixed.get_metrics()
    assert drafted > 0 and accepted / drafted > 0.85 * m["num_accepted_tokens"] / m["num_draft_tokens"]


def _eagle_head(tmp_path_factory) -> str:
    """A random EAGLE head for the demo target: drafts are poor, which exercises rejection paths."""
    target = load_target(DEMO_MODEL, dtype="float32")
    torch.manual_seed(1)
    config = DraftHeadConfig.for_target("eagle", target.config, (6,), None, "demo")
    directory = tmp_path_factory.mktemp("eagle_head")
    resolve_method("eagle").head_module(config).attach_target(target).save_pretrained(directory)
    return str(directory)


SERVABLE_CONFIGS = {
    "ngram": lambda _: {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 3},
    "eagle": lambda factory: {"method": "eagle", "model": _eagle_head(factory)},
    "eagle3": lambda _: {"method": "eagle3", "model": str(REPO / "assets" / "demo-code-7m-eagle3")},
    # the shipped heads draft one token per head: 3
    "medusa": lambda _: {"method": "medusa", "model": str(REPO / "assets" / "demo-code-7m-medusa"),
                         "num_speculative_tokens": 3},
    "mlp_speculator": lambda factory: {"method": "mlp_speculator",
                                        "model": random_mlp_speculator(factory.mktemp("mlp_speculator"))},
    "mtp": lambda _: {"method": "mtp", "model": str(REPO / "assets" / "demo-code-7m-mtp")},
    "suffix": lambda _: {"method": "suffix"},
    "draft_model": lambda _: {"method": "draft_model", "model": str(DEMO_MODEL)},
    "dflash": lambda _: {"method": "dflash", "model": str(REPO / "assets" / "demo-code-7m-dflash")},
    "dspark": lambda factory: {"method": "dspark", "model": str(_dspark_head(factory))},
    "peagle": lambda factory: {"method": "eagle3", "model": str(peagle_head(factory.mktemp("peagle"))),
                               "parallel_drafting": True},
}


def _dspark_head(tmp_path_factory):
    return dspark_head(load_target(DEMO_MODEL, dtype="float32"), tmp_path_factory.mktemp("dspark"))


def test_every_servable_method_is_covered():
    assert set(method_names(servable)) <= set(SERVABLE_CONFIGS)


@pytest.mark.parametrize("method", sorted(SERVABLE_CONFIGS))
def test_greedy_equality_with_adaptive_k(method, reference_ids, tmp_path_factory):
    config = {"num_speculative_tokens": 4, **SERVABLE_CONFIGS[method](tmp_path_factory)}
    llm = LLM(DEMO_MODEL, dtype="float32", device="cpu", max_num_seqs=3, max_model_len=256, speculative_config=config)
    # verification made nearly free, so the policy drafts and k varies with what each request accepts
    llm.engine.policy.cost.table = synthetic_table(0.02)
    llm.engine.policy.cost.live_scaling = False
    llm.engine.policy.confidence_floor = False  # the random EAGLE head is never confident
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == reference_ids
    m = llm.get_metrics()
    assert llm.engine.policy.needs_timing and m["num_drafts"] > 0


@pytest.mark.slow
def test_seeded_sampling_is_the_same_with_and_without_adaptive_speculation():
    """Deterministic drafts are verified against the token plain sampling draws at that position, so a seeded
    request samples the same text whatever k the policy picks (and with no speculation at all)."""
    params = [SamplingParams(temperature=0.9, top_p=0.95, seed=s, max_tokens=32) for s in range(len(PROMPTS))]
    plain = LLM(DEMO_MODEL, dtype="float32", device="cpu", max_num_seqs=3, max_model_len=256)
    config = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    spec = LLM(DEMO_MODEL, dtype="float32", device="cpu", max_num_seqs=3, max_model_len=256, speculative_config=config)
    spec.engine.policy.cost.table = CHEAP
    spec.engine.policy.cost.live_scaling = False
    expected = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, params, use_tqdm=False)]
    assert [o.outputs[0].token_ids for o in spec.generate(PROMPTS, params, use_tqdm=False)] == expected
    assert spec.get_metrics()["num_accepted_tokens"] > 0


TRIALS = 1500
DIST_PROMPT = "import numpy as np\n\n\ndef "


@pytest.mark.slow
def test_sampled_drafts_with_adaptive_k_follow_the_target_distribution():
    """EAGLE-3 sampled drafting under the policy: the second sampled token, after the most common first
    one, is distributed as the target says, whichever of plain sampling or verification produced it."""
    config = {"method": "eagle3", "model": str(REPO / "assets" / "demo-code-7m-eagle3"), "num_speculative_tokens": 2,
              "draft_sample_method": "probabilistic"}
    llm = LLM(DEMO_MODEL, dtype="float32", device="cpu", max_num_seqs=8, max_model_len=64, speculative_config=config)
    llm.engine.policy.cost.table = CHEAP
    llm.engine.policy.cost.live_scaling = False
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=3, ignore_eos=True) for i in range(TRIALS)]
    outputs = [o.outputs[0].token_ids for o in llm.generate([DIST_PROMPT] * TRIALS, params, use_tqdm=False)]
    m = llm.get_metrics()
    assert m["num_drafts"] > 0 and m["num_accepted_tokens"] > 0
    first = torch.tensor([o[0] for o in outputs])
    mode = int(first.mode().values)
    second = torch.tensor([o[1] for o in outputs if o[0] == mode])
    prompt_ids = llm.encode(DIST_PROMPT)[1] + [mode]
    with torch.inference_mode():
        p = torch.softmax(llm.model(torch.tensor([prompt_ids])).logits[0, -1], -1)
    top = p.topk(6).indices
    seen = torch.bincount(second, minlength=p.numel()).float() / len(second)
    bucket = lambda d: torch.cat([d[top], (1 - d[top].sum()).reshape(1)])  # noqa: E731
    tv = 0.5 * (bucket(seen) - bucket(p)).abs().sum().item()
    # 7-bucket total variation sampling noise at n samples is about 0.6 / sqrt(n)
    assert tv < 2.5 * 0.6 / len(second) ** 0.5 + 0.01, (tv, len(second))


def test_holding_says_whether_a_step_would_be_held_without_taking_one():
    """`holding` (asked at a prefill: may a proposer keep the prompt unfed?) is true during a hold after a
    clear loss at about the held batch size, false after a close call or for a smaller batch, and taking
    no step itself."""
    slots, limits = torch.arange(8), torch.full((8,), 4)
    lost = _policy(EXPENSIVE)
    _feed(lost, list(range(8)), accepted_each=0)
    assert lost.plan(slots, limits).width == 0
    assert lost.holding(8) and lost.holding(7) and not lost.holding(4)
    before = lost._hold
    assert lost.holding(8) and lost._hold == before  # asking books nothing
    while lost.held(tuple(range(8))):
        pass
    assert not lost.holding(8)  # the hold is over: the next step plans
    close = _policy(CHEAP)
    _feed(close, [0], accepted_each=4)
    close._hold, close._held_rows, close._clear_losses = 2, 1, 0  # a close call's short hold at one row
    assert close.held((0,)) and not close.holding(1)


def test_a_long_run_of_close_calls_keeps_new_prompts_unfed():
    """After LONG_PLAIN_RUN plain steps in a row, a close call's hold is a hold for prompts too: a batch that
    has not speculated for that long (8 in flight on a CPU) fed every new prompt to its head for nothing."""
    from draftsmith.serve.speculation.adaptive import LONG_PLAIN_RUN

    close = _policy(CHEAP)
    _feed(close, list(range(8)), accepted_each=4)
    close._hold, close._held_rows, close._clear_losses = 8, 8, 0
    close._plain_streak = (8, LONG_PLAIN_RUN - 1)
    assert not close.holding(8)
    assert close.held(tuple(range(8)))  # one more plain step
    assert close.holding(8) and not close.holding(4)  # about the held batch size only
    close._hold = 0
    assert not close.holding(8)  # the hold is over: the next step plans
    # a streak at 8 rows does not carry to one request left alone, which holds only a close call's few steps
    close._hold, close._held_rows = 2, 1
    assert close.held((0,)) and not close.holding(1)
    # the streak counts planned plain steps too, and a speculative plan ends it
    planner = _policy(EXPENSIVE)
    _feed(planner, list(range(8)), accepted_each=0)
    planner._plain_streak = (8, LONG_PLAIN_RUN)
    planner.plan(torch.arange(8), torch.full((8,), 4))
    assert planner._streak_at(8) == LONG_PLAIN_RUN + 1
    cheap = _policy(CHEAP)
    _feed(cheap, list(range(8)), accepted_each=4)
    cheap._plain_streak = (8, LONG_PLAIN_RUN)
    assert cheap.plan(torch.arange(8), torch.full((8,), 4)).width > 0 and cheap._streak_at(8) == 0
