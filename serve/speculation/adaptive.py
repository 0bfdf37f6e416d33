"""Adaptive speculation: each decode step, how many tokens to draft, chosen to maximise expected tokens/s.

Speculating pays only when the tokens it gains outweigh what it costs, and both sides move: acceptance
differs by request and by stretch of text, and the cost of verifying k+1 tokens per row grows with the batch
(on a small CPU target, 5 tokens x 1 row cost 1.1x one decode token but 5 x 32 rows cost 2.4x). So the
policy models both and picks, per step, the draft width w in 0..k (the config's num_speculative_tokens
is the cap) that maximises

    expected tokens / expected seconds = sum_rows (1 + sum_{j <= k_row} prod_{m <= j} a_row,m) / T(rows, w)

with k_row = min(w, the row's limit), a_row,m the row's acceptance rate at draft position m given the
earlier ones were accepted (exponentially decayed counts, shrunk toward the method's running rates,
which start optimistic so that speculation is tried), and T(rows, w) the step's seconds as the cost model
(`cost_model`) prices them; w = 0 is plain decoding. Plain steps teach nothing about drafting, so long
plain stretches are probed now and then (PROBE_AFTER).

For proposers that know their confidence, the policy also sets the confidence floor under which drafting
stops: one more sequential draft step costs about `c` seconds for the whole batch and gains each row's
chance `P` of getting that far, which pays while the rows' mean P exceeds c times a row's expected tokens
per second.
"""

from __future__ import annotations

import math
from dataclasses import replace

from draftsmith.serve.speculation.cost_model import CATCH_UP_HORIZON, CostModel
from draftsmith.serve.speculation.estimators import AcceptanceStats
from draftsmith.serve.speculation.plan import StepPlan, WidthCounts, int_list

FLOOR_MARGIN = 0.5
# The rules below; the measurements that set each value are in docs/decisions/adaptive-speculation.md.
PLAIN_HOLD = 8  # after a plan without speculation, the batch is re-planned this many steps later
# ... unless speculating came within CLOSE_CALL of plain decoding's tokens/s, for a batch of at most
# CLOSE_CALL_ROWS rows (a lone request's bad step is no reason to stop speculating for long): then the batch holds
# until the steps' fading of its acceptance evidence alone would make a plan speculate (`_steps_until_flip`), up
# to MAX_CLOSE_HOLD steps. Held steps bring no acceptance evidence, so a plan before then says the same at a
# price (at one in flight, the demo EAGLE-1 head planned every 5.7 steps at 0.29 ms a plan, 2% of its time),
# and one later leaves speculation off where it pays (tests/unit/test_planner_best_k.py). Proposers that draft
# before the plan hold CLOSE_HOLD steps, doubled by each close call in a row up to MAX_DRAFTED_CLOSE_HOLD: their
# plans follow drafts that say little about the next step's.
CLOSE_CALL, MAX_CLOSE_HOLD, CLOSE_CALL_ROWS = 0.9, 16, 4
CLOSE_HOLD, MAX_DRAFTED_CLOSE_HOLD = 2, 4
# ... and where speculating lost clearly (below CLOSE_CALL), each plan that says so again doubles the hold, up
# to MAX_PLAIN_HOLD steps (but not past a due probe): re-planning gives the same answer at a price
MAX_PLAIN_HOLD = 64
# plain steps in a row after which a close call's hold also keeps new prompts unfed (`holding`)
LONG_PLAIN_RUN = 64
# A hold goes on while the batch keeps all but 1/HOLD_SHRINK of its rows (a request finishing and the next
# joining do not reopen it)
HOLD_SHRINK = 8
# Plain steps teach the policy nothing about drafting. So after PROBE_AFTER plain steps in a row, a plan that
# still says no speculates anyway for PROBE_STEPS steps (the first resumes, the second is timed as a steady
# one) if it is predicted at least `probe_worst(rows)` of plain decoding's tokens/s; each probe that changes nothing
# doubles the wait, up to MAX_PROBE_AFTER steps. The wait starts again from PROBE_AFTER only after more than
# PROBE_STEPS speculative plans in a row: speculation that stops as soon as a probe would have (a new request
# drafting at the method's rates until its own evidence says no) changed nothing either, and resetting the
# wait there had a head that never paid probe, with its catch-up, every 16, 32, 64... steps of each request.
PROBE_AFTER, MAX_PROBE_AFTER, PROBE_STEPS, PROBE_WORST = 16, 256, 2, 0.7
# PROBE_WORST is one row's: a probe pays only where the rows' acceptance turns out above the estimate the plan
# was made with, and a batch's mean acceptance strays from its estimate by about 1/sqrt(rows) of what one row's
# does, so the shortfall a probe of `rows` rows may be predicted at shrinks as 1/sqrt(rows) (`probe_worst`).
# At 8 in flight the DSpark and DFlash demo heads' probes were predicted at 0.80-0.85x plain decoding and ran at
# 0.84-0.88x, catch-up aside (docs/decisions/adaptive-speculation.md)
# A resumed row's catch-up is priced spread over the steps it is expected to speculate (CATCH_UP_HORIZON).
# After SHORT_RUNS speculative runs in a row that ended within PROBE_STEPS plans, the next run is expected to
# be as short, and its catch-up is spread over PROBE_STEPS steps: while nothing is drafted the evidence fades
# toward the method's long-run rates read optimistically (`AcceptanceStats.idle`), and priced over 8 steps,
# such retries had the demo EAGLE-1 head (first draft accepted about 30%) catch up 58 positions and draft
# every 80-150 steps at one request in flight, for nothing.
SHORT_RUNS = 2
# A draft model is fed a new request's prompt at its first draft (`Proposer.unfed_rows`): a catch-up paid once
# per request that serves all its later drafts, so it is spread over the steps the request is expected to
# take (tokens left over tokens a step gives at the row's rates), up to FIRST_FEED_HORIZON (one that ends
# early at a stop token leaves the rest unpaid). Spread over CATCH_UP_HORIZON, the house model's PARD draft
# (1.2-1.3x on steady steps at one in flight) never started a request after its first: 115 ms of prompt over
# 8 steps of 25 ms. The plan weighs it against the whole batch's gain, and the rows fed bring only their share
# of that: with 8 in flight, one joining row's prompt is spread over a quarter of the steps (priced as if
# it served all 8 rows, a draft model speculated with every join and ran 0.89x plain decoding).
FIRST_FEED_HORIZON = 32
# Until this many rows have drafted since the engine started, a due probe is judged at acceptance no worse
# than the first guesses, and neither holds nor probes wait longer: a few early rejections must not keep
# speculation off for good
THIN_EVIDENCE = 16
# Position j's rate is re-measured only by plans at least j wide: where the method's decayed count of rows
# reaching the position after a plan's last one falls under THIN_POSITION, a plan drafts one more if that is
# predicted at least EXPLORE_WORST of the best plan's tokens/s
THIN_POSITION, EXPLORE_WORST = 4.0, 0.9
# ... but only where the rows' drafts reach that position at least EXPLORE_REACH of the time: a draft reached
# on fewer steps is measured on fewer, whatever is drafted, and the demo Medusa head (first draft accepted
# about 30%) drafted one deeper on about half its speculative plans at one request in flight; its exploring
# plans gave 0.88x plain decoding's tokens/s where the others gave 1.17x
EXPLORE_REACH = 0.3
# Per plan, the weight kept by the running share of rows that found drafts (proposers drafting before the plan)
DRAFT_SHARE_DECAY = 0.9
# Where the plain price of a batch size is stale (`CostModel.plain_stale`: never taken while speculating, or
# not for a few hundred speculative steps), the batch decodes plainly for REPRICE_STEPS steps: the step
# ledger times the plain step after SETTLING_STEPS (3) in a row, one in PLAIN_SAMPLE (4)
REPRICE_STEPS = 4
# rows' limits whose caps and query lengths `_widths` keeps (cleared when full)
WIDTHS_KEPT = 256


class AdaptivePolicy:
    """Chooses each step's draft width 0..k from the cost model and the acceptance it has seen (a
    `SpeculationPolicy`); none for a batch of more than `disable_by_batch_size` rows."""

    needs_timing = True  # the cost model learns from each step's device time

    def __init__(self, k: int, num_slots: int, cost: CostModel, disable_by_batch_size: int | None = None):
        self.k, self.cost, self.disable_by_batch_size = k, cost, disable_by_batch_size
        self.confidence_floor = True  # let confident proposers stop early (tests turn it off to force drafts)
        self.acceptance = AcceptanceStats(num_slots, k)
        self.counts = WidthCounts(k)
        # a plan without speculation holds while the batch keeps at least as many rows: plain steps left, that
        # row count, the slots last held and held steps whose idle decay is not yet applied to them
        self._hold, self._held_rows, self._held_slots, self._idle_steps = 0, 0, (), 0
        self._clear_losses = 0  # plain plans in a row where speculating lost clearly (MAX_PLAIN_HOLD)
        self._close_calls = 0  # plain plans in a row that were close calls (CLOSE_CALL)
        self._plain_run, self._probe_after, self._probing = 0, PROBE_AFTER, 0  # see PROBE_AFTER
        self._spec_run = 0  # speculative plans in a row (PROBE_AFTER)
        self._probe_worth = False  # whether the last plain plan's probe would have run, had one been due
        self._short_runs = 0  # speculative runs in a row of at most PROBE_STEPS plans (SHORT_RUNS)
        self._plain_streak = (0, 0)  # (batch size, plain steps in a row at about it): `holding`
        self._draft_share = 1.0  # proposers that draft before the plan: the share of rows with drafts, lately
        self._widths_by_limits: dict[tuple[int, ...], tuple[tuple[int, ...], list[float]]] = {}  # `_widths`

    def may_draft(self, rows: int) -> bool:
        """Whether a plan for this many rows can speculate at all."""
        return self.disable_by_batch_size is None or rows <= self.disable_by_batch_size

    def admit(self, slot: int) -> None:
        """A new request in `slot`: no evidence yet. A hold after a clear loss goes on (the method's rates,
        which the new row starts from, were in the plan that made it); one after a close call, timed by the
        last request's evidence (`_steps_until_flip`), ends."""
        if slot in self._held_slots:
            self._settle_idle()  # the held steps were the slot's last request's
            if self._close_calls:
                self._hold = 0
        self.acceptance.reset(slot)

    def held(self, slots: tuple[int, ...]) -> bool:
        """Whether this step of these rows (slot ids, in batch order) is plain without asking `plan`: a plan
        found that speculation did not pay, and plain steps bring no new acceptance evidence, so the answer
        holds for PLAIN_HOLD steps (after a close call, until fading alone could change it; up to MAX_PLAIN_HOLD
        after clear losses in a row) while the batch has about as many rows (HOLD_SHRINK) or more (requests finishing and new ones
        taking their slots do not reopen it; a smaller batch, where verifying is cheaper, does). A held step is
        booked here; the engine decodes it plainly with no speculative bookkeeping, so that a batch too large
        to speculate pays almost nothing for the question. A batch of more than `disable_by_batch_size` rows
        is held too."""
        if not self.may_draft(len(slots)):
            self._book_plain(slots)
            return True
        if not self._hold or len(slots) < self._held_rows - self._held_rows // HOLD_SHRINK:
            return False
        self._hold -= 1
        self._book_plain(slots)
        self._plain_run += 1
        self._plain_streak = (len(slots), self._streak_at(len(slots)) + 1)
        return True

    def holding(self, rows: int) -> bool:
        """A hold after clear losses, or after LONG_PLAIN_RUN plain steps in a row: a close call alone holds a
        few steps, after which a prompt kept unfed would be priced as a catch-up into the next plan (at one in
        flight that cost DFlash 2-3% of its speed); a batch that has not speculated for that long (8 in flight
        on a CPU, where verifying rarely pays) would otherwise feed every new prompt for nothing."""
        if not self.may_draft(rows):
            return True
        held = self._hold > 0 and rows >= self._held_rows - self._held_rows // HOLD_SHRINK
        return held and (self._clear_losses > 0 or self._streak_at(rows) >= LONG_PLAIN_RUN)

    def _streak_at(self, rows: int) -> int:
        """Plain steps in a row at about `rows` rows (within a HOLD_SHRINK-th of the streak's batch size): a
        streak at 8 in flight says nothing about one request left alone."""
        streak_rows, steps = self._plain_streak
        return steps if abs(rows - streak_rows) <= streak_rows // HOLD_SHRINK else 0

    def _book_plain(self, slots: tuple[int, ...]) -> None:
        """A step of these rows decodes plainly without a plan: counted, its idle decay deferred (`idle`)."""
        self._defer_idle(slots)
        self.counts.plain(len(slots))

    def plan(self, slots, limits, catch_up: tuple[int, int] = (0, 0), unfed: tuple[tuple[int, int], ...] = ()) -> StepPlan:
        """`slots[b]`, `limits[b]` (int sequences: lists, arrays, CPU tensors): row b's slot and the most it
        may draft (room left, max_tokens, or drafts it has); `catch_up`: the proposer's extra catch-up this
        step (`Proposer.catch_up`), so that resuming is priced in; `unfed`: (batch index, tokens left) of rows
        whose drafter has not been fed yet (see FIRST_FEED_HORIZON)."""
        slots, limits = int_list(slots), int_list(limits)
        if not self.may_draft(len(slots)):
            return StepPlan(0)
        self._settle_idle()
        rows = len(slots)
        if self.cost.plain_stale(rows):
            return self._reprice(slots)
        if self.cost.drafts_before_plan:
            share = sum(1 for n in limits if n) / rows
            self._draft_share = DRAFT_SHARE_DECAY * self._draft_share + (1 - DRAFT_SHARE_DECAY) * share
        rates = self.acceptance.rates(slots)
        caps, seconds = self._priced(rates, limits, catch_up, unfed)
        gain, best, speculative, plain = self._choose(rates, caps, seconds)
        # steady speculative steps at this batch size ran slower than plain decoding lately, whatever the
        # plans predicted (`realized`): plain, held as a clear loss, and probed as usual
        losing = self.cost.realized.loses(rows)
        if losing:
            best = plain
        elif not best.width and self._room_made_it_plain(rates, limits, catch_up, unfed):
            return best
        probe, thin = speculative, self.acceptance.evidence() < THIN_EVIDENCE
        if not best.width and thin and (self._probing or self._probe_due()):
            # too little evidence to trust a pessimistic estimate (see THIN_EVIDENCE): a probe is judged at
            # the first guesses
            floor = self.acceptance.initial_rates
            probe = self._choose([[max(r, i) for r, i in zip(row, floor)] for row in rates], caps, seconds)[2]
        best = self._explore(best, probe, plain, rows, catch_up, thin, bool(unfed))
        self._plain_streak = (rows, 0 if best.width else self._streak_at(rows) + 1)
        if best.width > 0 and self.cost.per_token_drafts and self.confidence_floor:
            # one more draft step costs a draft forward plus a wider verify; it pays while the row's chance
            # of acceptance exceeds that cost times the row's token rate. Draft confidences are not calibrated
            # acceptance rates (a one-layer head tends to be under-confident), hence the margin.
            step = max(self.cost.draft(rows, best.width + 1) - self.cost.draft(rows, best.width), 0.0) + max(
                self.cost.forward(rows, best.width + 2) - self.cost.forward(rows, best.width + 1), 0.0)
            best.stop_below = FLOOR_MARGIN * step * best.expected_tokens / best.expected_seconds / rows
        if best.width == 0:
            ratio = speculative.tokens_per_s / plain.tokens_per_s if speculative is not None else 0.0
            if losing:  # a measured loss, never a close call
                ratio = min(ratio, self.cost.realized.ratio(rows))
            elif self.cost.drafts_before_plan:
                # a step whose rows found few drafts says little about the next one's: hold by what a typical
                # step would do
                ratio = self._typical_ratio(gain, plain)
                if ratio >= 1.0:
                    self._hold = self._clear_losses = self._close_calls = 0
                    return best
            self._hold = self._plain_hold(slots, caps, seconds, ratio, losing or ratio < CLOSE_CALL, thin) - 1
            self._held_rows, self._held_slots = rows, tuple(slots)
        else:
            self._hold = self._clear_losses = self._close_calls = 0
            if not best.explore:
                best.row_rates = rates
        return best

    def _plain_hold(self, slots: list[int], caps: tuple[int, ...], seconds: list[float], ratio: float,
                    clear_loss: bool, thin: bool) -> int:
        """The steps a plan without speculation holds (itself included), where speculating was predicted at
        `ratio` of plain decoding's tokens/s: see CLOSE_CALL and MAX_PLAIN_HOLD."""
        self._clear_losses = self._clear_losses + 1 if clear_loss else 0
        self._close_calls = 0 if clear_loss else self._close_calls + 1
        if not clear_loss and len(slots) > CLOSE_CALL_ROWS:
            return PLAIN_HOLD
        if not clear_loss and self.cost.drafts_before_plan:
            return min(CLOSE_HOLD << (self._close_calls - 1), MAX_DRAFTED_CLOSE_HOLD)
        if not clear_loss:
            hold = self._steps_until_flip(slots, caps, seconds)
            # not past a due probe
            return min(hold, max(self._probe_after - self._plain_run + 1, 1)) if self._probe_worth else hold
        hold = min(PLAIN_HOLD << (self._clear_losses - 1), MAX_PLAIN_HOLD)
        # re-planned when a probe is due, where one would run (drafting after the plan: as `_explore` judged it,
        # whole catch-up included; an overdue probe that is not worth it caps nothing)
        if self._probe_worth or (self.cost.drafts_before_plan and (ratio >= probe_worst(len(slots)) or thin)):
            hold = min(hold, max(self._probe_after - self._plain_run, PLAIN_HOLD))
        return hold

    def _room_made_it_plain(self, rates: list[list[float]], limits: list[int], catch_up: tuple[int, int],
                            unfed: tuple[tuple[int, int], ...]) -> bool:
        """Whether a plain plan is down to rows with room for fewer than k drafts (a few tokens from their
        max_tokens or the context's end) where k drafts each would speculate. Such a plan says nothing about
        speculating, so no hold, loss, short run or probe follows from it: held as a loss, every request at one
        in flight began with PLAIN_HOLD plain steps, its predecessor's last token having made the call."""
        if self.cost.drafts_before_plan or all(n >= self.k for n in limits):  # drafts before the plan: `_typical_ratio`
            return False
        caps, seconds = self._priced(rates, [self.k] * len(limits), catch_up, unfed)
        return self._choose(rates, caps, seconds)[1].width > 0

    def _priced(self, rates: list[list[float]], limits: list[int], catch_up: tuple[int, int],
                unfed: tuple[tuple[int, int], ...]) -> tuple[tuple[int, ...], list[float]]:
        """-> each row's most drafts (its limit, at most k: a step of width w drafts min(w, cap) for the row), and
        each width's predicted seconds, the catch-up spread over its horizon."""
        caps, query_lens = self._widths(limits)
        seconds = self.cost.step_seconds_by_width(len(limits), query_lens, catch_up,
                                                  self._catch_up_horizon(rates, unfed))
        return caps, seconds

    def _widths(self, limits: list[int]) -> tuple[tuple[int, ...], list[float]]:
        """-> (each row's cap, min(limit, k); each width's mean verified tokens per row, what a packed verify
        costs), kept by the rows' limits: a batch plans with the same limits step after step."""
        key = tuple(limits)
        found = self._widths_by_limits.get(key)
        if found is None:
            if len(self._widths_by_limits) >= WIDTHS_KEPT:
                self._widths_by_limits.clear()
            caps = tuple(min(n, self.k) for n in limits)
            query_lens = [1 + sum(min(w, cap) for cap in caps) / len(caps) for w in range(self.k + 1)]
            found = self._widths_by_limits[key] = caps, query_lens
        return found

    def _reprice(self, slots: list[int]) -> StepPlan:
        """Plain, and held so for REPRICE_STEPS steps in all: what speculative steps are judged against
        (`realized`) and planned against is timed again."""
        self._hold, self._held_rows, self._held_slots = REPRICE_STEPS - 1, len(slots), tuple(slots)
        return StepPlan(0)

    def _catch_up_horizon(self, rates: list[list[float]], unfed: tuple[tuple[int, int], ...]) -> float:
        """The steps this step's catch-up is spread over: CATCH_UP_HORIZON, PROBE_STEPS after short runs, and
        for rows whose drafter is fed for the first time, the steps they are expected to take (FIRST_FEED_HORIZON)."""
        if self._short_runs >= SHORT_RUNS:
            return PROBE_STEPS
        if not unfed:
            return CATCH_UP_HORIZON
        # tokens a row-step gives at the widest plan, by the row's acceptance rates
        steps = max(1.0, min(FIRST_FEED_HORIZON, min(left / (1 + _gains(rates[b])[-1]) for b, left in unfed)))
        # the plan weighs the catch-up against the whole batch's gain, of which these rows bring their share
        return steps * len(unfed) / len(rates)

    def _choose(self, rates: list[list[float]], caps: tuple[int, ...], seconds: list[float]):
        """-> (gain, best plan, best speculative plan or None, plain plan) for rows with these acceptance rates;
        gain[b][w]: row b's expected extra tokens from drafting w."""
        gain, tokens = _tokens_by_width(rates, caps)
        plain = StepPlan(0, 0.0, tokens[0], max(seconds[0], 1e-9))
        best, speculative, candidates = plain, None, [plain]
        for width in range(1, len(tokens)):
            if tokens[width] <= tokens[width - 1]:
                break  # no row can use a wider step
            candidates.append(StepPlan(width, 0.0, tokens[width], max(seconds[width], 1e-9)))
            if candidates[-1].tokens_per_s > best.tokens_per_s:
                best = candidates[-1]
            if speculative is None or candidates[-1].tokens_per_s > speculative.tokens_per_s:
                speculative = candidates[-1]
        if best.width:
            best = speculative = self._one_deeper(best, candidates, gain)
        return gain, best, speculative, plain

    def _steps_until_flip(self, slots: list[int], caps: tuple[int, ...], seconds: list[float]) -> int:
        """Plain steps after which a plan of these rows, priced as this one, would first speculate because their
        acceptance evidence faded (`AcceptanceStats.rates` after idle steps); MAX_CLOSE_HOLD if none does."""
        for steps in range(1, MAX_CLOSE_HOLD + 1):
            tokens = _tokens_by_width(self.acceptance.rates(slots, idle_steps=steps), caps)[1]
            speeds = [t / max(s, 1e-9) for t, s in zip(tokens, seconds)]
            if max(speeds[1:]) > speeds[0]:
                return steps
        return MAX_CLOSE_HOLD

    def _one_deeper(self, best: StepPlan, candidates: list[StepPlan], gain: list[list[float]]) -> StepPlan:
        """`best`, or one draft more where the method's evidence at that position has faded (THIN_POSITION),
        the rows' drafts are likely to reach it (EXPLORE_REACH) and drafting it is predicted within
        EXPLORE_WORST of the best: a plan of w drafts never re-measures position w + 1, and an early unlucky
        estimate there would keep every later plan narrower than pays."""
        width = best.width
        if width + 1 >= len(candidates) or self.acceptance.reached_lately(width) >= THIN_POSITION:
            return best
        # the chance a row's draft w + 1 is reached: its first w accepted (gain[b][w] - gain[b][w - 1])
        reach = sum(row[width] - row[width - 1] for row in gain) / len(gain)
        if reach < EXPLORE_REACH:
            return best
        deeper = candidates[width + 1]
        return replace(deeper, explore=True) if deeper.tokens_per_s >= EXPLORE_WORST * best.tokens_per_s else best

    def _probe_due(self) -> bool:
        return not self._probing and self._plain_run >= self._probe_after

    def _typical_ratio(self, gain: list[list[float]], plain: StepPlan) -> float:
        """For proposers that draft before the plan: the best speculative width's tokens/s over plain decoding's
        on a step where rows have drafts as often as they have lately (`_draft_share`), each up to k, with the
        drafting that a held step skips priced in."""
        rows, share = len(gain), self._draft_share
        widths = range(1, self.k + 1)
        tokens = [rows + share * sum(row[w] for row in gain) for w in widths]
        seconds = self.cost.step_seconds_by_width(rows, [1.0, *(1 + share * w for w in widths)])[1:]
        if self.cost.per_token_drafts:
            drafting = [self.cost.drafting(rows, w) for w in widths]
        else:  # one pass drafts any width at one cost
            drafting = [self.cost.drafting(rows, 1)] * self.k
        return max(t / (s + d) for t, s, d in zip(tokens, seconds, drafting)) / plain.tokens_per_s

    def _explore(self, best: StepPlan, speculative: StepPlan | None, plain: StepPlan, rows: int,
                 catch_up: tuple[int, int], thin: bool = False, first_feed: bool = False) -> StepPlan:
        """`best`, or a probe of `speculative` when plain steps have gone on long enough (see PROBE_AFTER; with
        `thin` evidence, the wait does not grow). `first_feed`: the catch-up feeds rows whose drafter holds
        none of their positions yet (`Proposer.unfed_rows`)."""
        if best.width:
            self._plain_run, self._probing, self._spec_run = 0, 0, self._spec_run + 1
            if self._spec_run > PROBE_STEPS:
                self._probe_after, self._short_runs = PROBE_AFTER, 0
            return best
        if self._spec_run:
            self._short_runs += 1  # a longer run already reset the count
        self._spec_run = 0
        probe_worth = False
        if speculative is not None and not self.cost.drafts_before_plan:
            # A probe may be all the speculation there is for a while: its catch-up counts whole, not spread.
            # A first feed stays spread over the request's steps (FIRST_FEED_HORIZON), as it serves all its
            # later drafts: counted whole, a head that keeps prompts unfed while held (DFlash) owed each new
            # request's whole prompt at every probe, never probed again, and held plain for a whole run.
            whole = speculative.expected_seconds
            if not first_feed:
                whole += self.cost.catch_up(*catch_up) * (1 - 1 / CATCH_UP_HORIZON)
            probe_worth = speculative.expected_tokens / whole >= probe_worst(rows) * plain.tokens_per_s
        self._probe_worth = probe_worth  # read by the hold that `plan` sets after this
        if probe_worth and self._probe_due():
            self._probing, self._plain_run = PROBE_STEPS, 0
            if not thin:
                self._probe_after = min(2 * self._probe_after, MAX_PROBE_AFTER)
        if probe_worth and self._probing:
            self._probing -= 1
            return replace(speculative, explore=True)
        self._probing = 0
        self._plain_run += 1
        return best

    def idle(self, slots) -> None:
        """A plain step that was planned (not held): old acceptance and cost evidence fade, in one go with the
        steps after it at the next plan, as for held steps (a few small tensor ops a step otherwise)."""
        self._defer_idle(tuple(int_list(slots)))

    def _defer_idle(self, slots: tuple[int, ...]) -> None:
        if slots != self._held_slots:
            self._settle_idle()
            self._held_slots = slots
        self._idle_steps += 1

    def _settle_idle(self) -> None:
        """The held steps' idle decay, applied in one go."""
        if self._idle_steps:
            self.acceptance.idle(list(self._held_slots), self._idle_steps)
            self.cost.idle(self._idle_steps)
            self._idle_steps = 0

    def observe(self, slots, num_draft, accepted) -> None:
        self.acceptance.observe(slots, num_draft, accepted)

    def record(self, limits, width: int) -> None:
        self.counts.record(limits, width)

    def reset_metrics(self) -> None:
        self.counts = WidthCounts(self.k)

    def metrics(self) -> dict:
        return self.counts.metrics()


def probe_worst(rows: int) -> float:
    """The least share of plain decoding's predicted tokens/s at which a probe of `rows` rows runs: PROBE_WORST
    for one row, nearer 1 for more (the batch's mean acceptance strays from its estimate as 1/sqrt(rows))."""
    return 1.0 - (1.0 - PROBE_WORST) / math.sqrt(max(rows, 1))


def _gains(rates: list[float]) -> list[float]:
    """A row's expected extra tokens from drafting 0..k, given its conditional acceptance rates by position:
    0, a1, a1 + a1 a2, ..."""
    gains, reach = [0.0], 1.0
    for rate in rates:
        reach *= rate
        gains.append(gains[-1] + reach)
    return gains


def _tokens_by_width(rates: list[list[float]], caps: tuple[int, ...]) -> tuple[list[list[float]], list[float]]:
    """rates[b][j] (conditional acceptance by row and position), caps[b] (the most row b drafts) -> (gain[b][w]:
    row b's expected extra tokens from drafting w, tokens[w]: the batch's expected tokens from a step of width
    w, in which row b drafts min(w, caps[b]))."""
    gain = [_gains(row) for row in rates]
    widths = range(len(gain[0])) if gain else range(1)
    return gain, [len(gain) + sum(row[min(w, cap)] for row, cap in zip(gain, caps)) for w in widths]
