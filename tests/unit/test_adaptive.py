"""Adaptive speculation: the policy's k follows the cost model and the acceptance it sees, and speculation
stays lossless (greedy: token for token; sampled: in distribution) whatever k each step takes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from draftsmith.methods import method_names, resolve_method, servable
from draftsmith.models import load_target
from draftsmith.models.heads import DraftHeadConfig
from draftsmith.serve import LLM, SamplingParams
from draftsmith.serve.engine.outputs import OutputCollector
from draftsmith.serve.speculation.adaptive import (
    CLOSE_HOLD,
    HOLD_SHRINK,
    MAX_PLAIN_HOLD,
    PLAIN_HOLD,
    PROBE_AFTER,
    PROBE_STEPS,
    THIN_EVIDENCE,
    AdaptivePolicy,
)
from draftsmith.serve.speculation.cost_model import (
    CATCH_UP_HORIZON,
    COST_IDLE_DECAY,
    OUTLIER,
    PRIOR_WEIGHT,
    STEP_SURPRISE,
    CostModel,
)
from draftsmith.serve.speculation.estimators import AcceptanceStats, ScaleByBatch
from helpers import DEMO_MODEL, REPO, random_mlp_speculator, spec_config, synthetic_table

PROMPTS = [
    "x = 1\ny = 2\nz = 3\nx = 1\ny = ",
    "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a",
    "class Node:\n    def __init__(self, value, children=None):\n        self.value = value\n        self.children = chi",
    "for i in range(10):\n    print(i)\nfor i in range(10):\n    print(",
    "import os\nimport sys\nimport os\nimport ",
]
GREEDY = SamplingParams(temperature=0, max_tokens=40)


EXPENSIVE, CHEAP = synthetic_table(2.0, unit=0.05), synthetic_table(0.0)


def _policy(table, k=4, sequential=False):
    cost = CostModel(table, sequential_drafts=sequential, drafts_before_plan=not sequential)
    return AdaptivePolicy(k, num_slots=8, cost=cost)


def _feed(policy, slots, accepted_each: int, times: int = 10):
    slots = torch.tensor(slots)
    for _ in range(times):
        policy.acceptance.observe(slots, torch.full((len(slots),), policy.k), torch.full((len(slots),), accepted_each))


def _step(policy, slots, limits) -> int:
    """The width the engine runs this step: 0 while a plan without speculation holds, else a new plan's."""
    return 0 if policy.held(tuple(slots.tolist())) else policy.plan(slots, limits).width


def _settled(policy, slots, limits):
    """The plan once a change has had its effect: after a plan without speculation the policy holds it
    for the same rows for PLAIN_HOLD steps before it asks again."""
    for _ in range(PLAIN_HOLD):
        if not policy.held(tuple(slots.tolist())):
            return policy.plan(slots, limits)
    raise AssertionError(f"a plain plan held longer than PLAIN_HOLD={PLAIN_HOLD} steps")


def test_plain_plans_are_held_while_the_batch_does_not_shrink():
    policy = _policy(EXPENSIVE)
    _feed(policy, [0, 1], accepted_each=3)
    slots, limits = torch.tensor([0, 1]), torch.tensor([4, 4])
    assert policy.plan(slots, limits).width == 0
    policy.cost.table = CHEAP
    assert [_step(policy, slots, limits) for _ in range(PLAIN_HOLD)] == [0] * (PLAIN_HOLD - 1) + [4]
    assert policy.metrics()["num_steps_without_speculation"] == PLAIN_HOLD - 1  # held steps are counted
    policy.cost.table = EXPENSIVE
    assert policy.plan(slots, limits).width == 0
    policy.cost.table = CHEAP
    assert not policy.held((0,))  # fewer rows: planned at once
    assert policy.plan(torch.tensor([0]), torch.tensor([4])).width == 4
    policy.cost.table = EXPENSIVE
    assert policy.plan(slots, limits).width == 0
    policy.admit(1)  # a new request in a held slot, other slots, more rows: the hold goes on
    assert policy.held((0, 1)) and policy.held((2, 3)) and policy.held((0, 1, 2))


def _per_token_prices(per_token_cost):
    """Step prices for a policy: a plain step 1 s, a step of w drafts per_token_cost() s per verified token."""
    return lambda rows, query_lens, *args: [1.0] + [per_token_cost() * (w + 1) for w in range(1, len(query_lens))]


def test_a_hold_survives_a_slightly_smaller_batch():
    """At 16 in flight, the step that prefills a finished request's successor decodes 15 rows: still held (a
    plan for 15 rows would say what the plan for 16 said); a batch HOLD_SHRINK-th smaller or more is
    planned at once."""
    policy = AdaptivePolicy(4, num_slots=16, cost=CostModel(EXPENSIVE, sequential_drafts=False,
                                                                  drafts_before_plan=True))
    slots = torch.arange(16)
    assert policy.plan(slots, torch.full((16,), 4)).width == 0
    kept = 16 - 16 // HOLD_SHRINK
    assert policy.held(tuple(range(1, 16))) and policy.held(tuple(range(16 - kept, 16)))
    assert not policy.held(tuple(range(kept - 1)))


def test_a_close_call_is_held_briefly_a_clear_one_long(monkeypatch):
    """Plain by a small margin (a lone request after one bad draft step): re-planned after CLOSE_HOLD
    steps; plain by far (a big batch): after PLAIN_HOLD."""
    slots, limits = torch.tensor([0, 1]), torch.tensor([4, 4])
    for per_token_cost, hold in ((1.0, CLOSE_HOLD), (1.6, PLAIN_HOLD)):
        policy = _policy(CHEAP)
        _feed(policy, [0, 1], accepted_each=4)  # drafts all accepted: a step of w drafts yields about w + 1
        # plain: 1 s a step; w drafts: per_token_cost s per verified token, so speculation just misses (1.0)
        # or misses by far (1.6)
        monkeypatch.setattr(policy.cost, "step_seconds_by_width", _per_token_prices(lambda c=per_token_cost: c))
        assert policy.plan(slots, limits).width == 0
        steps = 1
        while policy.held((0, 1)):
            steps += 1
        assert steps == hold


def test_clear_losses_are_held_longer_each_time(monkeypatch):
    """Plan after plan where speculation loses clearly (a batch too large for it): each hold doubles, up to
    MAX_PLAIN_HOLD, so that planning costs almost nothing; a close call starts over."""
    policy = _policy(CHEAP)
    _feed(policy, [0, 1], accepted_each=4)
    slots, limits, per_token = torch.tensor([0, 1]), torch.tensor([4, 4]), {"cost": 3.0}  # 3.0: not worth a probe
    monkeypatch.setattr(policy.cost, "step_seconds_by_width", _per_token_prices(lambda: per_token["cost"]))

    def hold() -> int:
        assert policy.plan(slots, limits).width == 0
        steps = 1
        while policy.held((0, 1)):
            steps += 1
        return steps

    assert [hold() for _ in range(5)] == [PLAIN_HOLD, 2 * PLAIN_HOLD, 4 * PLAIN_HOLD, MAX_PLAIN_HOLD, MAX_PLAIN_HOLD]
    _feed(policy, [0, 1], accepted_each=4)  # the long holds faded the evidence
    per_token["cost"] = 1.0
    assert hold() == CLOSE_HOLD
    per_token["cost"] = 3.0
    assert hold() == PLAIN_HOLD


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


def _fed_rates(slots):
    fresh = _policy(EXPENSIVE)
    _feed(fresh, [0, 1], accepted_each=0)
    return fresh.acceptance.rates(slots)


def _widths(policy, slots, limits, steps: int) -> list[int]:
    return [_step(policy, slots, limits) for _ in range(steps)]


def test_long_plain_stretches_are_probed_with_backoff():
    """Plain steps bring no news about drafting, so a policy kept plain by pessimistic estimates tries
    speculation again now and then: after PROBE_AFTER plain steps, for PROBE_STEPS steps, each probe that
    does not change its mind doubling the wait; never when speculation is predicted far worse than plain."""
    slots, limits = torch.tensor([0, 1]), torch.tensor([4, 4])
    marginal = _policy(synthetic_table(0.9), sequential=True)
    _feed(marginal, [0, 1], accepted_each=1)
    widths = _widths(marginal, slots, limits, 1 + PROBE_AFTER + PROBE_STEPS + 2 * PROBE_AFTER + PROBE_STEPS)
    probes = [i for i, w in enumerate(widths) if w]
    first = PROBE_AFTER  # steps 0 .. PROBE_AFTER - 1 are plain
    assert probes[:PROBE_STEPS] == list(range(first, first + PROBE_STEPS))
    second = first + PROBE_STEPS + 2 * PROBE_AFTER
    assert probes[PROBE_STEPS:] == list(range(second, second + PROBE_STEPS))[: len(probes) - PROBE_STEPS]
    # not when speculation is predicted far worse; nor for proposers whose drafting the policy sees each step
    for hopeless in (_policy(EXPENSIVE, sequential=True), _policy(synthetic_table(1.2))):
        _feed(hopeless, [0, 1], accepted_each=1)
        assert not any(_widths(hopeless, slots, limits, 300))


def test_a_method_with_thin_evidence_is_probed_at_its_first_guesses():
    """Two rejected drafts (an engine's first request) must not keep speculation off for good: while fewer than
    THIN_EVIDENCE rows drafted, a due probe is judged at the first-guess rates and the waits do
    not grow; the same rejections THIN_EVIDENCE times over are believed (no probe: predicted far worse)."""
    slots, limits = torch.tensor([0]), torch.tensor([4])
    # a verified token costs 0.9 of a decode and a draft a third: at the first guesses one draft gives 0.76x
    # plain decoding's tokens/s (worth a probe), at the rates two rejections leave about 0.5x (not worth one)
    thin, believed = (_policy(synthetic_table(0.9), sequential=True) for _ in range(2))
    _feed(thin, [0], accepted_each=0, times=2)
    _feed(believed, [0], accepted_each=0, times=THIN_EVIDENCE)
    assert thin.acceptance.evidence() < THIN_EVIDENCE <= believed.acceptance.evidence()
    probes = [i for i, w in enumerate(_widths(thin, slots, limits, 2 * (PROBE_AFTER + PROBE_STEPS))) if w]
    assert probes == [PROBE_AFTER, PROBE_AFTER + 1, 2 * PROBE_AFTER + PROBE_STEPS, 2 * PROBE_AFTER + PROBE_STEPS + 1]
    assert not any(_widths(believed, slots, limits, 300))


def test_k_follows_the_cost_of_verification():
    policy = _policy(EXPENSIVE)
    _feed(policy, [0, 1], accepted_each=3)  # good drafts
    slots, limits = torch.tensor([0, 1]), torch.tensor([4, 4])
    assert policy.plan(slots, limits).width == 0
    policy.cost.table = CHEAP
    assert _settled(policy, slots, limits).width == 4
    policy.cost.table = EXPENSIVE
    assert policy.plan(slots, limits).width == 0


def test_k_follows_acceptance():
    policy = _policy(synthetic_table(0.15))
    slots, limits = torch.tensor([0, 1, 2]), torch.tensor([4, 4, 4])
    _feed(policy, [0, 1, 2], accepted_each=0, times=30)
    assert policy.plan(slots, limits).width == 0  # nothing gets accepted: don't draft
    _feed(policy, [0, 1, 2], accepted_each=4, times=30)
    assert _settled(policy, slots, limits).width == 4
    _feed(policy, [0, 1, 2], accepted_each=1, times=30)  # only the first draft lands
    assert policy.plan(slots, limits).width == 1


def test_rows_limits_cap_the_width():
    policy = _policy(CHEAP)
    _feed(policy, [0], accepted_each=4)
    assert policy.plan(torch.tensor([0]), torch.tensor([2])).width == 2
    assert policy.plan(torch.tensor([0]), torch.tensor([0])).width == 0


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


def test_draft_cost_separates_catch_up_from_each_draft_forward():
    """Timed proposes of 1..5 forwards at several batch sizes, costing F(rows, 1) x (0.2 + 0.35 per forward):
    the fit recovers both parts, and predicts a batch size it never saw through the forward table. Before any
    evidence it guesses a third of a decode per forward; one width seen extrapolates with that slope."""
    cost = CostModel(synthetic_table(0.1), sequential_drafts=True, drafts_before_plan=False)
    decode = cost.forward(4, 1)
    assert cost.draft(4, 3) == pytest.approx(decode)
    cost.observe_draft(4, 1, 0.55 * decode)
    weight = 1 / (1 + PRIOR_WEIGHT)  # one observation against the guess
    assert cost.draft(4, 1) == pytest.approx((weight * 0.55 + (1 - weight) / 3) * decode)
    assert cost.draft(4, 4) == pytest.approx((weight * (0.55 + 3 / 3) + (1 - weight) * 4 / 3) * decode, rel=0.05)
    for _ in range(20):
        for rows in (1, 2, 8):
            for forwards in range(1, 6):
                cost.observe_draft(rows, forwards, cost.forward(rows, 1) * (0.2 + 0.35 * forwards))
    for forwards in (1, 3, 5):
        assert cost.draft(6, forwards) == pytest.approx(cost.forward(6, 1) * (0.2 + 0.35 * forwards), rel=0.02)
    assert CostModel(CHEAP, sequential_drafts=False, drafts_before_plan=False).draft(4, 4) == \
        pytest.approx(CHEAP.estimate(4, 1) / 3)  # one forward drafts every token


def test_a_block_drafter_is_priced_by_the_targets_forward_of_its_block():
    """A proposer whose one draft forward runs a block of q tokens a row (DFlash) is priced against the target's
    forward of q tokens a row, at first its own guess times it, then as measured at one batch size: another
    batch size follows that forward's growth (not a decode's), and a plan's step prices the same drafting."""
    table = synthetic_table(0.3)
    cost = CostModel(table, sequential_drafts=False, drafts_before_plan=False, draft_query_len=8, draft_guess=0.5)
    assert cost.draft(4, 6) == pytest.approx(0.5 * cost.forward(4, 8))
    for _ in range(30):
        cost.observe_draft(1, 1, 0.8 * cost.forward(1, 8))
    assert cost.draft(8, 6) == pytest.approx(0.8 * cost.forward(8, 8), rel=0.02)
    assert cost.forward(8, 8) > 2 * cost.forward(8, 1)  # a decode-based price would be under half of it
    by_width = cost.step_seconds_by_width(8, [1.0, 2.0, 3.0])
    assert by_width[1:] == pytest.approx([cost.step_seconds(8, w) for w in (1, 2)])


def test_cost_evidence_fades_over_plain_steps():
    """Drafting measured dear (cold starts: a kernel compiled per new shape) is not re-measured while steps
    stay plain; over plain steps it fades back to the first guess, so the policy tries speculation again."""
    cost = CostModel(synthetic_table(0.3), sequential_drafts=True, drafts_before_plan=False)
    guess = cost.draft(4, 3)
    for _ in range(30):
        cost.observe_draft(4, 3, 3 * guess)
    dear = cost.step_seconds(4, 3)
    cost.idle(10)
    assert cost.step_seconds(4, 3) < dear
    cost.idle(400)
    assert cost.draft(4, 3) == pytest.approx(guess, rel=0.02)
    assert COST_IDLE_DECAY**400 < 1e-4


def test_catch_up_cost_is_learned_per_query_token():
    """Proposes that began with a catch-up forward teach its cost per query token (rows x their longest
    pending run), beyond what as many steady draft forwards cost; an odd stall moves it OUTLIER x at most."""
    cost = CostModel(synthetic_table(0.1), sequential_drafts=True, drafts_before_plan=False)
    for forwards in (1, 3):
        cost.observe_draft(4, forwards, cost.forward(4, 1) * (0.2 + 0.3 * forwards))
    guess = cost.catch_up(2, 30)
    assert guess > 0 and cost.step_seconds(4, 3, (2, 30)) == pytest.approx(cost.step_seconds(4, 3) + guess / CATCH_UP_HORIZON)
    per_token = 2 * guess / (2 * 31)  # the real catch-up costs twice the guess
    for _ in range(30):
        steady = cost.draft(4, 3)
        cost.observe_catch_up((2, 30), 4, 3, steady + per_token * 2 * 31)
    assert cost.catch_up(2, 30) == pytest.approx(2 * guess, rel=0.03)  # the guess keeps a weight of PRIOR_WEIGHT
    assert cost.catch_up(8, 30) == pytest.approx(4 * cost.catch_up(2, 30))  # four times the tokens
    cost.observe_catch_up((2, 30), 4, 3, 1e3)  # a stall
    assert cost.catch_up(2, 30) < 2 * guess * (1 + (OUTLIER - 1) * 0.21)
    # a stalled first catch-up (nothing learned before it) is priced OUTLIER x the guess at most, else a
    # request would never resume drafting: plain steps never re-measure it
    fresh = CostModel(synthetic_table(0.1), sequential_drafts=True, drafts_before_plan=False)
    first_guess = fresh.catch_up(1, 58)
    fresh.observe_catch_up((1, 58), 1, 1, 10.0)
    assert first_guess < fresh.catch_up(1, 58) <= OUTLIER * first_guess * 1.0001


def test_a_plan_prices_every_width_as_step_seconds_does():
    """The policy prices all widths in one call: the same seconds as pricing each on its own, with every
    part learned (decode and verify scales, drafting, host work, corrections, a catch-up)."""
    for sequential, before in ((True, False), (False, True)):
        cost = CostModel(synthetic_table(0.3), sequential_drafts=sequential, drafts_before_plan=before)
        cost.observe_forward(8, 1, 0.02)
        cost.observe_forward(8, 3.5, 0.05)
        cost.observe_draft(8, 3, 0.01)
        cost.observe_draft(8, 1, 0.004)
        cost.observe_host(8, True, 0.001)
        cost.observe_host(8, False, 0.0005)
        cost.observe_step(8, 3, 0.09, 3.5)
        cost.observe_catch_up((2, 30), 8, 3, 0.03)
        query_lens = [1.0, 1.0, 2.5, 3.5, 4.25]  # a width where no row drafts verifies at query length 1
        expected = [cost.step_seconds(8, w, (2, 30), query_lens[w] if w else None) for w in range(5)]
        assert cost.step_seconds_by_width(8, query_lens, (2, 30)) == pytest.approx(expected, rel=1e-12)


def test_speculative_steps_are_priced_as_they_turn_out():
    """Steady speculative steps that take longer in all than their parts predict make every speculative
    width dearer by that much (a moving average); one step moves it at most as if STEP_SURPRISE x off, so a
    cold first step cannot price speculation out; plain steps keep their price."""
    cost = CostModel(synthetic_table(0.3), sequential_drafts=True, drafts_before_plan=False)
    plain, spec = cost.step_seconds(8, 0), cost.step_seconds(8, 3)
    cost.observe_step(8, 3, 100 * spec)
    first = STEP_SURPRISE ** (1 / ScaleByBatch.FIRST_WEIGHT)  # a first observation weighs 1/FIRST_WEIGHT
    assert cost.spec_corrections.get(8) == pytest.approx(first)
    for _ in range(150):
        cost.observe_step(8, 3, 1.2 * spec)
    assert cost.spec_corrections.get(8) == pytest.approx(1.2, rel=0.01)
    assert cost.step_seconds(8, 3) == pytest.approx(1.2 * spec, rel=0.01)
    assert cost.step_seconds(8, 0) == plain
    cost.live_scaling = False  # synthetic tables price steps alone
    cost.observe_step(8, 3, 100 * spec)
    assert cost.spec_corrections.get(8) == pytest.approx(1.2, rel=0.01)


def test_corrections_are_learned_per_batch_size():
    """Speculative steps that turn out dearer at 16 rows than at 4 (longer padded attention, more draft
    work per row) are priced so at 16 rows within about ten steps there, without changing the price at 4; a
    batch size never seen borrows its nearest neighbour's correction."""
    cost = CostModel(synthetic_table(0.3), sequential_drafts=True, drafts_before_plan=False)
    at4, at16 = cost.step_seconds(4, 3), cost.step_seconds(16, 3)
    for _ in range(100):
        cost.observe_step(4, 3, 1.1 * at4)
    assert cost.step_seconds(16, 3) == pytest.approx(1.1 * at16, rel=0.01)  # borrowed from 4 rows
    for _ in range(8):
        cost.observe_step(16, 3, 1.5 * at16)
    assert cost.step_seconds(16, 3) > 1.35 * at16
    assert cost.step_seconds(4, 3) == pytest.approx(1.1 * at4, rel=0.01)
    assert cost.step_seconds(32, 3) > 1.35 * cost._spec_parts(32, 3, None)  # nearest: 16 rows'
    # verify forwards likewise: a verify scale learned at 2 rows does not price 16 rows' verifies once seen
    cost.observe_forward(2, 4.0, 1.0 * cost.table.estimate(2, 4.0))
    for _ in range(12):
        cost.observe_forward(16, 4.0, 1.4 * cost.table.estimate(16, 4.0))
    assert cost.forward(16, 4.0) > 1.3 * cost.table.estimate(16, 4.0)
    assert cost.forward(2, 4.0) < 1.05 * cost.table.estimate(2, 4.0)
    # and decodes: plain steps of 16 rows running at 1.5x the profile do not make 1 row's dearer
    for _ in range(12):
        cost.observe_forward(1, 1, 0.9 * cost.table.estimate(1, 1))
        cost.observe_forward(16, 1, 1.5 * cost.table.estimate(16, 1))
    assert cost.step_seconds(16, 0) - cost.host(16, False) > 1.3 * cost.table.estimate(16, 1)
    assert cost.step_seconds(1, 0) - cost.host(1, False) < 0.95 * cost.table.estimate(1, 1)


def test_one_stalled_step_does_not_price_speculation_out():
    """A speculative step's host work that stalls (1 s against 1 ms) counts as OUTLIER x the prediction at
    most: plain steps never re-measure it, so unclipped it would keep speculation off for good."""
    cost = CostModel(synthetic_table(0.3), sequential_drafts=True, drafts_before_plan=False)
    for _ in range(20):
        cost.observe_host(8, True, 1e-3)
    cost.observe_host(8, True, 1.0)
    assert cost.host(8, True) < 1e-3 * (1 + OUTLIER)
    for _ in range(200):  # a real change still gets there, OUTLIER x at a time
        cost.observe_host(8, True, 0.1)
    assert cost.host(8, True) == pytest.approx(0.1, rel=0.05)


@pytest.mark.slow
def test_an_engines_first_steps_teach_the_cost_model_nothing():
    """The first steps of each kind run cold; the cost model learns from the steps after COLD_STEPS of them,
    and from plain steps only once SETTLING_STEPS of them in a row have followed a speculative one."""
    from draftsmith.serve.engine.step_accounting import COLD_STEPS, SETTLING_STEPS

    llm = LLM(DEMO_MODEL, dtype="float32", device="cpu", max_num_seqs=1, max_model_len=256,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1})
    engine, cost = llm.engine, llm.engine.policy.cost
    cost.table, cost.live_scaling = CHEAP, False  # so that it speculates too
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
        elif spec or plain_run > SETTLING_STEPS:
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


def test_acceptance_counts_each_position_reached():
    stats = AcceptanceStats(num_slots=3, k=3, decay=1.0)
    stats.observe(torch.tensor([0, 1, 2]), torch.tensor([3, 2, 0]), torch.tensor([1, 2, 0]))
    assert stats.reached.tolist() == [[1, 1, 0], [1, 1, 0], [0, 0, 0]]
    assert stats.accepted.tolist() == [[1, 0, 0], [1, 1, 0], [0, 0, 0]]
    before = stats.rates(torch.tensor([0]))[0, 1].item()
    for _ in range(50):
        stats.idle(torch.tensor([0]))  # old evidence fades back to the method's rate
    after = stats.rates(torch.tensor([0]))[0, 1].item()
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
    poor = stats.rates([1])[0, 0]  # a new request's rate: the method's
    assert poor < 0.3
    stats.idle([0], 60)
    assert stats.rates([1])[0, 0] < 0.3  # a first guess of 0.7 would have been back by now
    stats.idle([0], 10_000)
    assert stats.rates([1])[0, 0] > 0.6


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
}


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


def test_speculative_corrections_fade_over_plain_steps():
    """Speculative steps and verify forwards that measured dear (a slow stretch of the machine) are priced
    so for a while, then, over plain steps that re-measure neither, fade back toward the model's parts:
    otherwise one slow stretch kept speculation off for the rest of a run."""
    cost = CostModel(synthetic_table(0.3), sequential_drafts=True, drafts_before_plan=False)
    fresh = cost.step_seconds(1, 3)
    for _ in range(30):
        cost.observe_step(1, 3, 1.5 * cost._spec_parts(1, 3, None))
        cost.observe_forward(1, 4.0, 1.5 * cost.table.estimate(1, 4.0))
    dear = cost.step_seconds(1, 3)
    assert dear > 1.5 * fresh
    cost.idle(10)
    assert fresh < cost.step_seconds(1, 3) < dear  # fading, not forgotten
    cost.idle(400)
    assert cost.step_seconds(1, 3) == pytest.approx(fresh, rel=0.05)
