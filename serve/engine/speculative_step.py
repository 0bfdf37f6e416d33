"""One speculative decode step, as a pipeline of returned values:

    limits  = draft_limits(rows, k, max_model_len)                the most each row may draft
    drafted = plan_and_propose(engine, rows, limits, sampling)    the policy's plan and the proposer's drafts
    checked = verify_drafts(engine, rows, drafts, num_draft, ...) one target forward of [last token, drafts]
    finish_step(engine, rows, num_draft, checked, ...)            the proposer and the policy observe, the rows
                                                                  take tokens

A step the policy holds, plans at width 0, or where no row has a draft, decodes plainly (`LLMEngine._plain_decode`).
The engine (`serve.engine.core`) owns the forwards, sampling and the requests; this module only orders them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from draftsmith.methods.proposer_base import DraftBatch
from draftsmith.serve.engine.request import Request
from draftsmith.serve.engine.sampling import SamplingBatch
from draftsmith.serve.speculation.plan import StepPlan
from draftsmith.serve.speculation.tree_verify import size_trees, verify_tree
from draftsmith.serve.speculation.verify import verified_tokens
from draftsmith.serve.speculation.verify_length import size_chains, size_chains_by_rates


@dataclass(frozen=True)
class Drafted:
    """What drafting gave one step: the plan, the drafts (None where drafting raised), what the rows could
    have drafted (the policy records it), the seconds drafting took, and the catch-up it priced."""

    plan: StepPlan | None
    drafts: DraftBatch | None
    planned_limits: list[int] | torch.Tensor
    draft_s: float = 0.0
    catch_up: tuple[int, int] = (0, 0)
    # drafts per row before the drafter's confidence cut them (`size_chains`; None: no cut). The policy learns
    # from these, a dropped draft counting as one not accepted: the cut keeps only the confident drafts, so
    # their acceptance alone would tell the policy that a plan of w drafts yields more than it does.
    offered: list[int] | None = None

    @property
    def failed(self) -> bool:
        """Drafting raised (`LLMEngine.propose` failed the rows at fault): the step decodes plainly."""
        return self.drafts is None and (self.plan is None or self.plan.width > 0)

    def num_draft(self, rows: int) -> list[int]:
        """Drafts per row the verify forward scores (0 for every row when the plan is plain)."""
        return self.drafts.counts.tolist() if self.plan.width else [0] * rows


@dataclass(frozen=True)
class Verified:
    """One verify forward: its output (logits, hidden states), the tokens each row keeps (accepted drafts and
    the target's next token), how many, and the seconds of the forward and of verification."""

    out: object
    kept: list[list[int]]
    counts: list[int]
    query_lens: list[int]
    forward_s: float
    verify_s: float


def draft_limits(rows: list[Request], k: int, max_model_len: int) -> list[int]:
    """The most each row may draft: k, less where its context or max_tokens would not hold the drafts and the
    token after them."""
    limits = []
    for r in rows:
        room = max_model_len - r.num_tokens - 1
        left = (r.params.max_tokens - len(r.output_token_ids) - 1) if r.params.max_tokens else k
        limits.append(max(0, min(k, room, left)))
    return limits


def unfed_rows_left(proposer, rows: list[Request], max_model_len: int) -> tuple[tuple[int, int], ...]:
    """(batch index, tokens it may still generate) of each row whose drafter holds none of its positions yet."""
    def left(row: Request) -> int:
        room = max_model_len - row.num_tokens
        return room if row.params.max_tokens is None else min(room, row.params.max_tokens - len(row.output_token_ids))
    return tuple((b, left(rows[b])) for b in proposer.unfed_rows(rows))


def plan_and_propose(engine, rows: list[Request], limits: list[int], sampling: SamplingBatch) -> Drafted:
    """The policy plans the step and the proposer drafts for it. A proposer that drafts cheaply drafts first,
    and the plan is then made knowing which rows have drafts; else the plan comes first (with the catch-up the
    proposer owes) and sizes the drafting."""
    proposer, policy, clock = engine.proposer, engine.policy, engine.clock
    draft_sampling = sampling if engine.sample_drafts else None
    slots = [r.slot for r in rows]
    if proposer.propose_first and policy.may_draft(len(rows)):
        draft_at = clock()
        drafts = engine.propose(rows, limits, draft_sampling)
        draft_s = clock() - draft_at
        if drafts is None:
            return Drafted(None, None, limits, draft_s)
        planned = drafts.counts.cpu()
        plan = policy.plan(slots, planned)
        drafts.counts.clamp_(max=plan.width)
        if drafts.confidence is not None and policy.cost is not None and plan.width and not plan.explore:
            # the policy learns from the drafts verified: the cut, not its plan, weighs each row's confidence
            size_chains(drafts, len(rows), policy.cost, draft_s)
        else:
            _cut_by_rates(drafts, len(rows), plan, policy, draft_s)
        return Drafted(plan, drafts, planned, draft_s)
    catch_up = proposer.catch_up(rows)
    unfed = unfed_rows_left(proposer, rows, engine.config.max_model_len) if catch_up[0] else ()
    plan = policy.plan(slots, limits, catch_up, unfed)
    if not plan.width:
        return Drafted(plan, None, limits, 0.0, catch_up)
    draft_at = clock()
    # a tree is drafted whole and sized after (size_trees), not capped by a chain's width
    widths = limits if proposer.tree is not None else [min(n, plan.width) for n in limits]
    drafts = engine.propose(rows, widths, draft_sampling, plan.stop_below)
    draft_s = clock() - draft_at
    offered = None
    if drafts is not None and drafts.confidence is not None and policy.cost is not None:
        if drafts.parents is not None:
            size_trees(drafts, len(rows), policy.cost, draft_s)
        else:
            offered = drafts.counts[: len(rows)].tolist()
            size_chains(drafts, len(rows), policy.cost, draft_s)
    elif drafts is not None and drafts.parents is None:
        _cut_by_rates(drafts, len(rows), plan, policy, draft_s)
    return Drafted(plan, drafts, limits, draft_s, catch_up, offered)


def _cut_by_rates(drafts: DraftBatch, rows: int, plan: StepPlan, policy, draft_s: float) -> None:
    """Cuts each of the rows' chains by the acceptance rates the plan priced, where it priced them and there is
    more than one row (`size_chains_by_rates`); the policy learns from what is verified (a cut row's positions
    stay unmeasured)."""
    if plan.row_rates is not None and rows > 1:
        size_chains_by_rates(drafts, rows, plan.row_rates, policy.cost, draft_s)


def verify_drafts(engine, rows: list[Request], drafts: DraftBatch, num_draft: list[int],
                  sampling: SamplingBatch) -> Verified:
    """Scores [last token, drafts] of every row in one target forward and keeps what verifies: a chain
    through the engine's decode step (graphs where it has them), a tree with its own mask and positions."""
    width = 1 + max(num_draft)
    # on CPU the drafts are listed on the host once: a few ints a row, for the ids and for matching
    host_drafts = drafts.tokens[:, : width - 1].tolist() if drafts.tokens.device.type == "cpu" else None
    ids = _verify_ids(rows, drafts.tokens, host_drafts, width, engine.device)
    q_lens = [1 + n for n in num_draft]
    if drafts.parents is None:
        out, forward_at = engine.step_forward(ids, rows, q_lens)
        verify_at = engine.clock()
        with torch.inference_mode():
            kept = verified_tokens(out.logits, drafts, num_draft, sampling, engine.rejection_sampler,
                                   engine.spec_config.synthetic_acceptance_rate, host_drafts)
    else:  # a tree: its mask and rotary positions, its accepted path's K/V moved into place; eager
        engine.stats["num_forward_passes"] += 1
        forward_at = engine.clock()
        out, tokens, counts = verify_tree(engine.model, engine.cache, ids, [r.slot for r in rows],
                                          [r.num_tokens - 1 for r in rows], q_lens, drafts.parents, sampling,
                                          engine.feature_layers)
        verify_at = engine.clock()
        packed = torch.cat([tokens, counts[:, None]], dim=1).tolist()  # one device-to-host copy for both
        kept = [row[: row[-1]] for row in packed]
    verified_at = engine.clock()
    return Verified(out, kept, [len(row) for row in kept], q_lens, verify_at - forward_at, verified_at - verify_at)


def _verify_ids(rows: list[Request], draft_tokens: torch.Tensor, host_drafts: list[list[int]] | None, width: int,
                device: torch.device) -> torch.Tensor:
    """[B, width]: each row's last token, then its drafts; -1 padding becomes token 0 in padding slots. From
    `host_drafts` where the drafts were listed on the host (CPU), else made on the device without a sync."""
    if host_drafts is not None:
        return torch.tensor([[r.last_token] + [max(t, 0) for t in row] for r, row in zip(rows, host_drafts)],
                            dtype=torch.long, device=device)
    ids = torch.empty(len(rows), width, dtype=torch.long, device=device)
    ids[:, 0] = torch.tensor([r.last_token for r in rows], device=device)
    ids[:, 1:] = draft_tokens[:, : width - 1].clamp(min=0)
    return ids


def finish_step(engine, rows: list[Request], num_draft: list[int], checked: Verified,
                sampling: SamplingBatch, offered: list[int] | None = None) -> None:
    """The proposer gets the features of the last token and the accepted drafts, the policy the acceptance
    (of the drafts `offered` before a confidence cut, where one ran), the rows their tokens. K/V of the
    accepted positions are in the cache; rejected ones lie past each row's length and are overwritten:
    nothing to copy."""
    starts = [r.num_tokens - 1 for r in rows]
    engine.observe_features(rows, starts, checked.counts, checked.out)
    learned_from = offered if offered is not None else num_draft
    engine.policy.observe([r.slot for r in rows], learned_from, [n - 1 for n in checked.counts])
    engine.take_tokens(rows, checked.kept, checked.out.logits, sampling)
    for request, n_draft, new_tokens in zip(rows, num_draft, checked.kept):
        engine.spec_metrics.observe(n_draft, len(new_tokens) - 1)
        request.num_computed = request.num_tokens - 1
