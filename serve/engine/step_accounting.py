"""Where each decode step's time goes, and what the speculation policy's cost model learns from it.

The engine hands every finished decode step here (`StepLedger.book`): its draft, forward and verify seconds
go into the step profile (`draftsmith bench --profile`), and, for an engine that speculates adaptively, into
the cost model, except the steps that would teach it wrong prices (cold ones, unsettled plain ones: below).
"""

from __future__ import annotations

# where a decode step's time goes (`draftsmith bench --profile`): drafting, the target forward, sampling or
# verification, and the host work around them
STEP_PARTS = ("draft_s", "forward_s", "verify_s", "bookkeeping_s")
# An engine's first steps of each kind run cold (first-call dispatch, allocations, caches to fill) and take
# several times as long as the rest: the cost model does not learn from them.
COLD_STEPS = {"plain": 3, "speculative": 3, "catch_up": 2}
# A plain step right after a speculative one runs on caches the draft model and the wide verify left cold:
# plain prices are learned from the plain steps after this many in a row. The measurements behind both:
# docs/decisions/adaptive-speculation.md
SETTLING_STEPS = 3
# Settled plain steps teach the plain price from one in PLAIN_SAMPLE: it moves slowly (context grows a token a
# step), and learning it was 0.4% of a held step at one in flight, the largest of a held step's extra costs
PLAIN_SAMPLE = 4


def _fresh_profile() -> dict:
    return dict.fromkeys(STEP_PARTS, 0.0) | {"decode_steps": 0}


class StepLedger:
    def __init__(self):
        self.profile = _fresh_profile()
        self._cold = dict(COLD_STEPS)
        self._plain_run = SETTLING_STEPS  # plain decode steps since the last speculative one

    def reset_profile(self) -> None:
        self.profile = _fresh_profile()

    def book(self, rows: int, width: int, total: float, draft_s: float, forward_s: float, verify_s: float,
             cost, drafts=None, catch_up: tuple[int, int] = (0, 0), query_len: float = 1.0,
             tokens: int = 0) -> None:
        """One decode step of `rows` rows verifying up to `width` drafts (0: plain) that took `total` seconds;
        `cost`: the policy's cost model (None: nothing learns); `drafts`: the step's DraftBatch, whose
        `forwards` and `steady` say what drafting ran (None: it drafted nothing); `query_len`: the forward's
        mean real tokens per row (packed, that is what it costs); `tokens`: what a speculative step gave."""
        host = max(total - draft_s - forward_s, 0.0)
        profile = self.profile
        profile["decode_steps"] += 1
        profile["draft_s"] += draft_s
        profile["forward_s"] += forward_s
        profile["verify_s"] += verify_s
        profile["bookkeeping_s"] += host - verify_s
        if cost is None:
            return
        # a speculative step is steady unless its drafting began with a one-off catch-up
        forwards, steady = (drafts.forwards, drafts.steady) if drafts is not None else (0, True)
        kind = "plain" if not width else "speculative" if steady or not draft_s else "catch_up"
        self._plain_run = self._plain_run + 1 if kind == "plain" else 0
        if self._cold[kind]:
            self._cold[kind] -= 1
            return
        if kind != "plain" or (self._plain_run > SETTLING_STEPS and self._plain_run % PLAIN_SAMPLE == 0):
            cost.observe_forward(rows, query_len, forward_s)
            cost.observe_host(rows, bool(width), host)
        if kind == "speculative":
            # drafting done before the plan is sunk when it is made, and so is not in its prediction
            cost.observe_step(rows, width, total - (draft_s if cost.drafts_before_plan else 0.0), query_len)
            cost.observe_yield(rows, tokens, total)
        if draft_s and forwards:
            if kind == "speculative":
                cost.observe_draft(rows, forwards, draft_s)
            else:
                cost.observe_catch_up(catch_up, rows, forwards, draft_s)
