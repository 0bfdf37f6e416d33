"""What the engine asks of a speculation policy (`SpeculationPolicy`), the policy that keeps k fixed
(`FixedPolicy`), and the one factory that picks a policy from the speculative config (`make_policy`).

A policy answers, each decode step, how many tokens each row may draft (a `StepPlan`), and learns from what the
engine tells it: the requests it admits, the acceptance of every verified step, plain steps. It declares what
it needs from the engine (`needs_timing`, `cost`); the engine reads those, never the policy's class.
"""

from __future__ import annotations

import logging
from typing import Protocol

from draftsmith.serve.speculation.adaptive import AdaptivePolicy
from draftsmith.serve.speculation.cost_model import CostModel
from draftsmith.serve.speculation.cost_profile import (
    CATCH_UP_GRID,
    DRAFT_GRID,
    ForwardCostTable,
    load_or_profile,
    profile_catch_ups,
    profile_drafts,
    profile_forwards,
)
from draftsmith.serve.speculation.plan import StepPlan, WidthCounts, int_list

logger = logging.getLogger("draftsmith")


class SpeculationPolicy(Protocol):
    """The members the engine and the speculative step call. Slots and limits are int sequences (lists, arrays,
    CPU tensors) in batch order: row b's cache slot and the most it may draft this step."""

    k: int  # num_speculative_tokens: no plan is wider
    # the cost model that the step ledger teaches and trees are sized by; None: the policy learns no prices
    cost: CostModel | None

    @property
    def needs_timing(self) -> bool:
        """Whether the engine must time each step's parts on the device (on CUDA: at a price) for the policy."""

    def may_draft(self, rows: int) -> bool:
        """Whether a plan for this many rows can speculate at all (proposers that draft before the plan ask)."""

    def admit(self, slot: int) -> None:
        """A new request in `slot`: what the policy knew of the slot's last request is dropped."""

    def held(self, slots: tuple[int, ...]) -> bool:
        """Whether this step of these rows decodes plainly without a plan (booked as a plain step if so)."""

    def holding(self, rows: int) -> bool:
        """Whether a step of this many rows would be held now (`held`), asked without taking a step: a proposer
        may then keep a prompt's features instead of feeding them to its head at once."""

    def plan(self, slots, limits, catch_up: tuple[int, int] = (0, 0), unfed: tuple[tuple[int, int], ...] = ()) -> StepPlan:
        """This step's plan; `catch_up`: the proposer's catch-up before it can draft (`Proposer.catch_up`);
        `unfed`: (batch index, tokens it may still generate) of the rows whose drafter holds none of their
        positions yet (`Proposer.unfed_rows`)."""

    def observe(self, slots, num_draft, accepted) -> None:
        """A verified step: row b drafted num_draft[b] tokens, of which accepted[b] were accepted."""

    def record(self, limits, width: int) -> None:
        """A planned step ran at `width` (0: plain) for rows that could draft `limits` (for the metrics)."""

    def idle(self, slots) -> None:
        """A planned step ran plainly (the plan said 0, or no row had drafts)."""

    def metrics(self) -> dict:
        """`spec_k_histogram` and `num_steps_without_speculation`."""

    def reset_metrics(self) -> None:
        """Zeroes the metrics; what the policy learned is kept."""


class FixedPolicy:
    """Drafts the config's k every step, or vLLM's num_speculative_tokens_per_batch_size table's k for the
    batch's size; none above `disable_by_batch_size` rows. It learns nothing, so it never asks for timings."""

    cost = None
    needs_timing = False

    def __init__(self, k: int, per_batch_size: list[tuple[int, int, int]] | None = None,
                 disable_by_batch_size: int | None = None):
        self.k, self.per_batch_size, self.disable_by_batch_size = k, per_batch_size, disable_by_batch_size
        self.counts = WidthCounts(k)

    def width(self, rows: int) -> int:
        """The drafts per row a batch of `rows` rows runs."""
        if self.disable_by_batch_size is not None and rows > self.disable_by_batch_size:
            return 0
        for lo, hi, width in self.per_batch_size or ():
            if lo <= rows <= hi:
                return width
        return self.k

    def may_draft(self, rows: int) -> bool:
        return self.width(rows) > 0

    def admit(self, slot: int) -> None:
        pass

    def held(self, slots: tuple[int, ...]) -> bool:
        return False

    def holding(self, rows: int) -> bool:
        return not self.may_draft(rows)

    def plan(self, slots, limits, catch_up: tuple[int, int] = (0, 0), unfed: tuple[tuple[int, int], ...] = ()) -> StepPlan:
        return StepPlan(min(self.width(len(slots)), max(int_list(limits))))

    def observe(self, slots, num_draft, accepted) -> None:
        pass

    def record(self, limits, width: int) -> None:
        self.counts.record(limits, width)

    def idle(self, slots) -> None:
        pass

    def metrics(self) -> dict:
        return self.counts.metrics()

    def reset_metrics(self) -> None:
        self.counts = WidthCounts(self.k)


def make_policy(spec_config, proposer, num_slots: int, cost_table: ForwardCostTable | None,
                target) -> SpeculationPolicy:
    """The engine's policy for `spec_config`: adaptive (its cost model priced from `cost_table`, measured on
    `target` now where there is none), or fixed (`adaptive: false`, or vLLM's per-batch-size table)."""
    k, per_batch_size = spec_config.num_speculative_tokens, spec_config.num_speculative_tokens_per_batch_size
    disable_above = spec_config.disable_by_batch_size
    if not spec_config.adaptive or per_batch_size is not None:
        logger.info("speculation: %s", "fixed k" if per_batch_size is None else
                    "k by batch size (num_speculative_tokens_per_batch_size)")
        return FixedPolicy(k, per_batch_size, disable_above)
    if cost_table is None:  # no model folder to key a cached profile by: measure, keep in memory
        cost_table = profile_forwards(target, {"model": "in-memory"})
    cost = CostModel(cost_table, per_token_drafts=proposer.per_token_drafts, drafts_before_plan=proposer.propose_first,
                     draft_query_len=proposer.draft_query_len, draft_guess=proposer.draft_cost_guess,
                     catch_up_table=_catch_up_table(proposer, num_slots), draft_table=_draft_table(proposer, num_slots))
    logger.info("speculation: adaptive (0..k per step, from the cost model)")
    return AdaptivePolicy(k, num_slots, cost, disable_above)


def _draft_table(proposer, num_slots: int) -> ForwardCostTable | None:
    """The table of a proposer's draft forward by rows (`Proposer.draft_timer`: a one-pass drafter's steady
    step, a per-token drafter's one-token step), timed now; None: drafting is priced from the target's table
    until it is timed live."""
    timer = proposer.draft_timer(DRAFT_GRID["context"])
    if timer is None:
        return None
    rows = [r for r in DRAFT_GRID["rows"] if r <= num_slots] or [1]
    return profile_drafts(timer, rows, DRAFT_GRID["repeats"])


def _catch_up_table(proposer, num_slots: int) -> ForwardCostTable | None:
    """The forward-cost table of the model a proposer's catch-ups run through, where it is a whole language model
    (`Proposer.catch_up_model`): from the disk cache, or measured now (a few seconds, once per model); or the
    table of its own catch-up projection (`Proposer.catch_up_timer`), timed now. None: catch-ups are priced
    from the target's table and learned."""
    drafter = proposer.catch_up_model()
    if drafter is not None:
        table, cached = load_or_profile(*drafter, **CATCH_UP_GRID)
        if not cached:
            logger.info("profiled draft model forwards (%s) to price its catch-ups", drafter[1])
        return table
    timer = proposer.catch_up_timer()
    if timer is None:
        return None
    rows = [r for r in CATCH_UP_GRID["rows"] if r <= num_slots] or [1]
    positions = [q for q in CATCH_UP_GRID["query_lens"] if q <= timer.most_positions]
    return profile_catch_ups(timer.run, rows, positions, CATCH_UP_GRID["repeats"], timer.device)
