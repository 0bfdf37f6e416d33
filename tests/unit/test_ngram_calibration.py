"""The n-gram proposer's confidence: acceptance rates by match length, learned from what rows went on to write
(`draftsmith.methods.ngram.calibration`), and the engine verifying in a busy batch only the drafts they say pay."""

from __future__ import annotations

import time

import torch

from draftsmith.methods.ngram.calibration import AGREE_CAP, PRIOR_RATE, MatchCalibration, bucket_of
from draftsmith.methods.ngram.proposer import NgramProposer
from draftsmith.serve.engine.request import Request
from draftsmith.serve.engine.sampling_params import SamplingParams
from draftsmith.serve.speculation.config import parse_speculative_config

K = 4


def _request(rid, tokens, slot):
    r = Request(str(rid), tokens, SamplingParams(), torch.Generator())
    r.slot = slot
    return r


def _proposer(slots=8):
    config = parse_speculative_config({"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 2,
                                       "prompt_lookup_max": 4})
    return NgramProposer(config, None, max_num_seqs=slots, max_model_len=256)


def test_buckets_and_the_prior():
    assert [bucket_of(n) for n in (1, 2, 3, 4, 5, 7, 8, 15, 16, 40)] == [0, 1, 2, 3, 4, 4, 5, 5, 6, 6]
    calibration = MatchCalibration(K, 2)
    assert calibration.survival([0, 2]) == [[0.0] * K, [PRIOR_RATE ** (j + 1) for j in range(K)]]


def test_a_proposal_settles_against_what_the_row_wrote():
    """Each draft up to the first that differs from the tokens written counts a trial, whether or not the
    engine verified it; a proposal made at another length, or for a slot's earlier request, counts nothing."""
    calibration = MatchCalibration(K, 2)
    calibration.remember(1, 10, 5, [7, 8, 9, 6])
    calibration.settle(1, 10, [7, 8, 3])  # two accepted, the third differs
    bucket = bucket_of(5)
    assert calibration.trials[bucket] == [1, 1, 1, 0] and calibration.accepted[bucket] == [1, 1, 0, 0]
    calibration.settle(1, 10, [7, 8, 9, 6])  # settled already
    assert calibration.trials[bucket] == [1, 1, 1, 0]
    calibration.remember(0, 10, 5, [7, 8])
    calibration.settle(0, 11, [7, 8])  # not the length it followed
    calibration.remember(0, 12, 5, [7, 8])
    calibration.forget(0)
    calibration.settle(0, 12, [7, 8])
    assert calibration.trials[bucket] == [1, 1, 1, 0]
    calibration.remember(0, 12, 5, [7, 8])
    calibration.settle(0, 12, [7])  # one token written (a plain step): only the first draft is known
    assert calibration.trials[bucket] == [2, 1, 1, 0] and calibration.accepted[bucket] == [2, 1, 0, 0]


def _copying_and_misled():
    """Rows 0-3 copy a 20-token block, writing 4 tokens a step that their drafts foretell; rows 4-7 end on a
    2-token match ("5 6") whose continuation they never write."""
    block = list(range(100, 120))
    copying = [_request(i, block + block[:6], i) for i in range(4)]
    misled = [_request(4 + i, [50 + i, 5, 6, 9, 60 + i, 61 + i, 5, 6], 4 + i) for i in range(4)]

    def write(step: int) -> None:
        for row in copying:
            length = len(row.all_token_ids())
            row.output_token_ids += [block[(length + j) % 20] for j in range(K)]
        for row in misled:
            row.output_token_ids += [70 + step, 80 + step, 5, 6]
    return copying + misled, write


def test_the_proposer_learns_that_long_matches_are_accepted_and_short_ones_not():
    """The proposer's confidence comes to rank every draft after a long match above every draft after a
    short one that misled."""
    proposer = _proposer()
    rows, write = _copying_and_misled()
    for step in range(12):
        drafts = proposer.propose(rows, [K] * len(rows))
        assert drafts.counts[: len(rows)].tolist() == [K] * len(rows)
        write(step)
    confidence = drafts.confidence[: len(rows)]
    assert proposer.agreed[:4].tolist() == [AGREE_CAP] * 4 and proposer.agreed[4:8].tolist() == [2] * 4
    assert confidence[:4].min() > 0.5 and confidence[4:, 0].max() < 0.15


def test_a_busy_batch_verifies_only_the_drafts_that_pay():
    """At 8 in flight, where each verified token costs a quarter of a decode step, the engine's step keeps
    the copying rows' drafts and drops every draft of the misled rows (`plan_and_propose` ->
    `size_chains`), and the policy learns only from what is verified."""
    from draftsmith.serve.engine.speculative_step import plan_and_propose
    from draftsmith.serve.speculation.adaptive import AdaptivePolicy
    from draftsmith.serve.speculation.cost_model import CostModel
    from helpers import synthetic_table

    proposer = _proposer()
    rows, write = _copying_and_misled()
    for step in range(12):
        proposer.propose(rows, [K] * len(rows))
        write(step)
    cost = CostModel(synthetic_table(0.25), per_token_drafts=False, drafts_before_plan=True)
    cost.live_scaling = False
    policy = AdaptivePolicy(K, len(rows), cost)

    class Engine:
        sample_drafts = False
        clock = staticmethod(time.perf_counter)

        def __init__(self):
            self.proposer, self.policy = proposer, policy

        def propose(self, batch, limits, sampling, stop_below=0.0):
            return proposer.propose(batch, limits)

    drafted = plan_and_propose(Engine(), rows, [K] * len(rows), None)
    assert drafted.plan.width == K and not drafted.plan.explore
    assert drafted.drafts.counts[: len(rows)].tolist() == [K] * 4 + [0] * 4 and drafted.offered is None
