"""The cost model the adaptive policy prices steps with: draft, catch-up and host costs learned from timings,
corrections per batch size, outliers clipped, and evidence that fades over plain steps."""

from __future__ import annotations

import pytest

from draftsmith.serve.speculation.cost_model import (
    CATCH_UP_HORIZON,
    COST_IDLE_DECAY,
    OUTLIER,
    PRIOR_WEIGHT,
    STEP_SURPRISE,
    CostModel,
)
from draftsmith.serve.speculation.cost_profile import ForwardCostTable
from draftsmith.serve.speculation.estimators import ScaleByBatch
from helpers import synthetic_table

CHEAP = synthetic_table(0.0)


def test_draft_cost_separates_catch_up_from_each_draft_forward():
    """Timed proposes of 1..5 forwards at several batch sizes, costing F(rows, 1) x (0.2 + 0.35 per forward):
    the fit recovers both parts, and predicts a batch size it never saw through the forward table. Before any
    evidence it guesses a third of a decode per forward; one width seen extrapolates in proportion to the forwards
    (not with the guessed slope, whose error the fixed part would absorb)."""
    cost = CostModel(synthetic_table(0.1), per_token_drafts=True, drafts_before_plan=False)
    decode = cost.forward(4, 1)
    assert cost.draft(4, 3) == pytest.approx(decode)
    cost.observe_draft(4, 1, 0.55 * decode)
    weight = 1 / (1 + PRIOR_WEIGHT)  # one observation against the guess
    assert cost.draft(4, 1) == pytest.approx((weight * 0.55 + (1 - weight) / 3) * decode)
    assert cost.draft(4, 4) == pytest.approx((weight * 4 * 0.55 + (1 - weight) * 4 / 3) * decode, rel=0.05)
    for _ in range(20):
        for rows in (1, 2, 8):
            for forwards in range(1, 6):
                cost.observe_draft(rows, forwards, cost.forward(rows, 1) * (0.2 + 0.35 * forwards))
    for forwards in (1, 3, 5):
        assert cost.draft(6, forwards) == pytest.approx(cost.forward(6, 1) * (0.2 + 0.35 * forwards), rel=0.02)
    assert CostModel(CHEAP, per_token_drafts=False, drafts_before_plan=False).draft(4, 4) == \
        pytest.approx(CHEAP.estimate(4, 1) / 3)  # one forward drafts every token


def test_a_block_drafter_is_priced_by_the_targets_forward_of_its_block():
    """A proposer whose one draft forward runs a block of q tokens a row (DFlash) is priced against the target's
    forward of q tokens a row, at first its own guess times it, then as measured at one batch size: another
    batch size follows that forward's growth (not a decode's), and a plan's step prices the same drafting."""
    table = synthetic_table(0.3)
    cost = CostModel(table, per_token_drafts=False, drafts_before_plan=False, draft_query_len=8, draft_guess=0.5)
    assert cost.draft(4, 6) == pytest.approx(0.5 * cost.forward(4, 8))
    for _ in range(30):
        cost.observe_draft(1, 1, 0.8 * cost.forward(1, 8))
    assert cost.draft(8, 6) == pytest.approx(0.8 * cost.forward(8, 8), rel=0.02)
    assert cost.forward(8, 8) > 2 * cost.forward(8, 1)  # a decode-based price would be under half of it
    by_width = cost.step_seconds_by_width(8, [1.0, 2.0, 3.0])
    assert by_width[1:] == pytest.approx([cost.step_seconds(8, w) for w in (1, 2)])


def test_a_timed_draft_step_prices_drafting_by_rows():
    """Where the draft step was timed by rows at load (`draft_table`), drafting is priced as timed at every batch
    size, however the target's forward of a block grows; live timings at one batch size correct the level at
    all, and once their evidence fades the price is the timed one again, not a guess from the target's table."""
    timed = ForwardCostTable({"drafting": "timed"}, [1, 8], [1], 256, [[2.5e-3], [7e-3]])
    cost = CostModel(synthetic_table(0.3), per_token_drafts=False, drafts_before_plan=False, draft_query_len=7,
                     draft_guess=0.5, draft_table=timed)
    assert cost.draft(1, 7) == pytest.approx(2.5e-3) and cost.draft(8, 3) == pytest.approx(7e-3)
    assert cost.draft(4, 7) == pytest.approx(2.5e-3 + 3 * 4.5e-3 / 7)  # interpolated by rows
    for _ in range(30):
        cost.observe_draft(8, 1, 1.2 * 7e-3)
    assert cost.draft(1, 7) == pytest.approx(1.2 * 2.5e-3, rel=0.02)
    by_width = cost.step_seconds_by_width(8, [1.0, 2.0, 3.0])
    assert by_width[1:] == pytest.approx([cost.step_seconds(8, w) for w in (1, 2)])
    cost.idle(500)
    assert cost.draft(8, 7) == pytest.approx(7e-3, rel=0.01)


def test_cost_evidence_fades_over_plain_steps():
    """Drafting measured dear (cold starts: a kernel compiled per new shape) is not re-measured while steps
    stay plain; over plain steps it fades back to the first guess, so the policy tries speculation again."""
    cost = CostModel(synthetic_table(0.3), per_token_drafts=True, drafts_before_plan=False)
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
    cost = CostModel(synthetic_table(0.1), per_token_drafts=True, drafts_before_plan=False)
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
    fresh = CostModel(synthetic_table(0.1), per_token_drafts=True, drafts_before_plan=False)
    first_guess = fresh.catch_up(1, 58)
    fresh.observe_catch_up((1, 58), 1, 1, 10.0)
    assert first_guess < fresh.catch_up(1, 58) <= OUTLIER * first_guess * 1.0001


def test_catch_up_cost_has_a_fixed_part_and_a_part_per_token():
    """Short and long catch-ups teach both parts (replaying kept steps costs something whatever their number):
    a long one is not priced at a short one's cost per token. A learned price under the guess stands through
    plain steps (the next catch-up it lets run re-measures it); one over the guess fades back toward it."""
    cost = CostModel(synthetic_table(0.1), per_token_drafts=False, drafts_before_plan=False)
    cost.observe_draft(1, 1, cost.forward(1, 1) * 0.5)
    fixed, per_token = 0.2e-3, 1e-6  # far under the guess, which prices each token as a draft forward's share
    for positions in (2, 60, 5, 40) * 10:
        cost.observe_catch_up((1, positions), 1, 1, cost.drafting(1, 1) + fixed + per_token * (1 + positions))
    assert cost.catch_up(1, 30) == pytest.approx(fixed + per_token * 31, rel=0.05)
    assert cost.catch_up(1, 60) < 1.5 * cost.catch_up(1, 2)  # per token from the short one: 13x
    assert cost.catch_up(1, 60) < cost._catch_up_guess(1, 60) / 10
    learned = cost.catch_up(1, 60)
    cost.idle(200)
    assert cost.catch_up(1, 60) == pytest.approx(learned)
    dear = CostModel(synthetic_table(0.1), per_token_drafts=False, drafts_before_plan=False)
    guess = dear.catch_up(1, 60)
    for _ in range(10):
        dear.observe_catch_up((1, 60), 1, 1, dear.drafting(1, 1) + 2 * guess)
    assert dear.catch_up(1, 60) > 1.8 * guess
    dear.idle(200)
    assert dear.catch_up(1, 60) == pytest.approx(guess, rel=0.05)


def test_a_draft_models_catch_up_is_priced_by_its_own_table_alone():
    """Where catch-ups run a whole draft model, that model's profiled table prices them: what the extra positions
    add to its first draft forward. Live catch-ups teach nothing: a short one (a few positions, whose fixed
    costs dominate) once priced a prompt's catch-up at 3-4x what it took."""
    draft_table = synthetic_table(0.05, unit=0.25e-3)  # a quarter of the target's decode, cheap per token
    cost = CostModel(synthetic_table(0.1), per_token_drafts=False, drafts_before_plan=False,
                     catch_up_table=draft_table)
    expected = draft_table.estimate(1, 1 + 600) - draft_table.estimate(1, 1)
    assert cost.catch_up(1, 600) == pytest.approx(expected)
    assert cost.catch_up(1, 600) < CostModel(synthetic_table(0.1), per_token_drafts=False,
                                             drafts_before_plan=False).catch_up(1, 600)
    cost.observe_catch_up((1, 10), 1, 1, 1.0)  # a short catch-up that took a second
    assert cost.catch_up(1, 600) == pytest.approx(expected)


def test_a_plan_prices_every_width_as_step_seconds_does():
    """The policy prices all widths in one call: the same seconds as pricing each on its own, with every
    part learned (decode and verify scales, drafting, host work, corrections, a catch-up)."""
    for sequential, before in ((True, False), (False, True)):
        cost = CostModel(synthetic_table(0.3), per_token_drafts=sequential, drafts_before_plan=before)
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
    cost = CostModel(synthetic_table(0.3), per_token_drafts=True, drafts_before_plan=False)
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
    cost = CostModel(synthetic_table(0.3), per_token_drafts=True, drafts_before_plan=False)
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
    cost = CostModel(synthetic_table(0.3), per_token_drafts=True, drafts_before_plan=False)
    for _ in range(20):
        cost.observe_host(8, True, 1e-3)
    cost.observe_host(8, True, 1.0)
    assert cost.host(8, True) < 1e-3 * (1 + OUTLIER)
    for _ in range(200):  # a real change still gets there, OUTLIER x at a time
        cost.observe_host(8, True, 0.1)
    assert cost.host(8, True) == pytest.approx(0.1, rel=0.05)


def test_speculative_corrections_fade_over_plain_steps():
    """Speculative steps and verify forwards that measured dear (a slow stretch of the machine) are priced
    so for a while, then, over plain steps that re-measure neither, fade back toward the model's parts:
    otherwise one slow stretch kept speculation off for the rest of a run."""
    cost = CostModel(synthetic_table(0.3), per_token_drafts=True, drafts_before_plan=False)
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
