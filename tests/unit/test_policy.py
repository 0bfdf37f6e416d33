"""Speculation policies as the engine sees them: `make_policy` resolves one from the config, each declares what
it needs (timings, a cost model), and vLLM's `disable_by_batch_size` turns speculation off above a batch size
under either policy."""

from __future__ import annotations

import pytest
import torch

from draftsmith.serve import LLM, SamplingParams
from draftsmith.serve.speculation.adaptive import AdaptivePolicy
from draftsmith.serve.speculation.config import parse_speculative_config
from draftsmith.serve.speculation.cost_model import CostModel
from draftsmith.serve.speculation.policy import FixedPolicy, make_policy
from helpers import CODE_PROMPTS, DEMO_MODEL, REPO, spec_config, synthetic_table

EAGLE3_HEAD = REPO / "assets" / "demo-code-7m-eagle3"


class _Proposer:
    """What `make_policy` reads of a proposer to price its drafting."""

    per_token_drafts, propose_first, draft_query_len, draft_cost_guess = True, False, 1, None

    def catch_up_model(self):  # catch-ups priced from the target's table
        return None

    def catch_up_timer(self):
        return None

    def draft_timer(self, context):  # drafting priced from the target's table
        return None


def _policy(config: dict):
    return make_policy(parse_speculative_config(config), _Proposer(), 4, synthetic_table(0.1), None)


def test_the_config_picks_the_policy_and_the_policy_declares_its_needs():
    adaptive = _policy({"method": "ngram", "num_speculative_tokens": 4})  # the product default
    fixed = _policy(spec_config("ngram", k=4))
    table = _policy({"method": "ngram", "num_speculative_tokens": 4,
                     "num_speculative_tokens_per_batch_size": [[1, 2, 3]]})
    assert adaptive.needs_timing and adaptive.cost is not None
    for policy in (fixed, table):
        assert not policy.needs_timing and policy.cost is None


def test_fixed_k_and_vllm_batch_size_table():
    fixed = FixedPolicy(4)
    assert fixed.plan(torch.tensor([0]), torch.tensor([4])).width == 4
    assert fixed.plan(torch.tensor([0, 1]), torch.tensor([2, 1])).width == 2  # no row can draft more
    table = FixedPolicy(4, per_batch_size=[(1, 2, 3), (3, 4, 1), (5, 8, 0)])
    widths = [table.plan(torch.arange(b), torch.full((b,), 4)).width for b in (1, 2, 3, 4, 5, 8)]
    assert widths == [3, 3, 1, 1, 0, 0]
    assert [table.may_draft(b) for b in (4, 5)] == [True, False]


def test_disable_by_batch_size_turns_speculation_off_above_it_under_either_policy():
    fixed = FixedPolicy(4, disable_by_batch_size=2)
    assert [fixed.plan(torch.arange(b), torch.full((b,), 4)).width for b in (1, 2, 3, 8)] == [4, 4, 0, 0]
    adaptive = AdaptivePolicy(4, 8, CostModel(synthetic_table(0.0), per_token_drafts=True, drafts_before_plan=False),
                              disable_by_batch_size=2)
    assert not adaptive.held((0, 1)) and adaptive.plan(torch.arange(2), torch.full((2,), 4)).width > 0
    assert adaptive.held((0, 1, 2)) and adaptive.plan(torch.arange(3), torch.full((3,), 4)).width == 0
    assert adaptive.metrics()["num_steps_without_speculation"] == 1  # the held step is counted


@pytest.mark.parametrize("adaptive", [False, True])
def test_an_engine_decodes_batches_above_disable_by_batch_size_plainly(target, greedy_reference, adaptive):
    config = spec_config("eagle3", EAGLE3_HEAD, 3, disable_by_batch_size=2, adaptive=adaptive)
    llm = LLM(DEMO_MODEL, dtype="float32", device="cpu", max_num_seqs=3, max_model_len=256, target=target,
              speculative_config=config)
    if adaptive:  # verifying priced free, so that below the limit it drafts whatever this machine's speed
        llm.engine.policy.cost.table, llm.engine.policy.cost.live_scaling = synthetic_table(0.0), False
        llm.engine.policy.confidence_floor = False
    steps, account = [], llm.engine._account
    llm.engine._account = lambda rows, width, *args: steps.append((len(rows), width)) or account(rows, width, *args)
    outputs = llm.generate(CODE_PROMPTS, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == greedy_reference
    assert all(width == 0 for rows, width in steps if rows > 2) and any(rows > 2 for rows, _ in steps)
    assert any(width > 0 for rows, width in steps if rows <= 2)


def test_a_proposers_own_catch_up_is_timed_into_the_table_that_prices_it():
    """A proposer whose catch-ups are a projection of its own (`catch_up_timer`) has them timed over the
    catch-up grid, within the rows it has slots for and the positions its cache holds, and priced by that
    table alone: what the kept positions add to its first draft forward's shape."""
    from draftsmith.methods.proposer_base import CatchUpTimer

    calls = []

    class Projecting(_Proposer):
        per_token_drafts, draft_query_len = False, 9

        def catch_up_timer(self):
            return CatchUpTimer(lambda rows, positions: calls.append((rows, positions)), 200, torch.device("cpu"))

    config = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 4})
    policy = make_policy(config, Projecting(), 2, synthetic_table(0.1), None)
    table = policy.cost.catch_up_table
    assert table.rows == [1, 2] and table.query_lens == [1, 8, 32, 128]  # 4 rows > 2 slots; 512 > 200
    assert sorted(set(calls)) == [(r, q) for r in (1, 2) for q in (1, 8, 32, 128)]
    assert policy.cost.catch_up(2, 100) == pytest.approx(table.estimate(2, 109) - table.estimate(2, 9))
    policy.cost.observe_catch_up((1, 10), 1, 1, 5.0)  # a live catch-up that stalled teaches nothing
    assert policy.cost.catch_up(2, 100) == pytest.approx(table.estimate(2, 109) - table.estimate(2, 9))


def test_a_one_pass_drafters_step_is_timed_by_rows_into_the_table_that_prices_it():
    """A proposer drafting any width in one forward that can time its steady step (`Proposer.draft_timer`) is
    priced by that table, timed within the engine's slots at the target table's context, its slots handed back
    after; one drafting a forward a token that times its one-token step is priced that per draft forward, and
    one without a timer is not timed."""
    from draftsmith.methods.proposer_base import DraftTimer
    from draftsmith.serve.speculation.cost_profile import CONTEXT

    calls, contexts, done = [], [], []

    class Timed(_Proposer):
        per_token_drafts, draft_query_len = False, 7

        def draft_timer(self, context):
            contexts.append(context)
            return DraftTimer(calls.append, lambda: done.append(True), torch.device("cpu"))

    config = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 4})
    policy = make_policy(config, Timed(), 3, synthetic_table(0.1), None)
    table = policy.cost.draft_table
    assert contexts == [CONTEXT] and table.rows == [1, 2] and sorted(set(calls)) == [1, 2] and done == [True]
    assert policy.cost.draft(2, 4) == pytest.approx(table.estimate(2, 1))
    Timed.per_token_drafts, Timed.draft_query_len = True, 1
    per_token = make_policy(config, Timed(), 3, synthetic_table(0.1), None).cost
    assert per_token.draft(2, 3) == pytest.approx(3 * per_token.draft_table.estimate(2, 1))
    assert make_policy(config, _Proposer(), 3, synthetic_table(0.1), None).cost.draft_table is None
