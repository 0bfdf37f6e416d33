"""Live drift: the served head's acceptance per position over its newest drafts beside its record, on
/metrics, and one warning when it stays below the share of the record the gate asks for."""

import logging

from draftsmith.acceptance_record import Acceptance
from draftsmith.serve.openai.acceptance_drift import (
    LOW_WINDOWS,
    WINDOW_DRAFTS,
    AcceptanceDrift,
    served_record,
)
from draftsmith.serve.openai.metrics import ServerMetrics
from draftsmith.serve.speculation.config import parse_speculative_config
from helpers import DEMO_MODEL

RECORD = Acceptance(2, 2.2, [0.8, 0.4], "check", "calibration")  # gain 1.2: below 0.96 a step is low


class Counts:
    """Cumulative counts as the engine reports them: each window of WINDOW_DRAFTS drafts at these rates."""

    def __init__(self):
        self.accepted, self.drafted = [0, 0], [0, 0]

    def window(self, rates):
        self.accepted = [a + round(r * WINDOW_DRAFTS) for a, r in zip(self.accepted, rates)]
        self.drafted = [d + WINDOW_DRAFTS for d in self.drafted]
        return list(self.accepted), list(self.drafted)


def test_live_rates_are_over_each_window_and_a_warning_waits_for_several(caplog):
    drift, counts = AcceptanceDrift(RECORD), Counts()
    assert not drift.observe(*counts.window([0.8, 0.4]))  # the first report is the baseline
    assert not drift.observe([a + 1 for a in counts.accepted], [d + 10 for d in counts.drafted])  # window open
    assert drift.observe(*counts.window([0.78, 0.4]))
    assert drift.live[1] == 0.4 and not drift.below_record
    with caplog.at_level(logging.WARNING, logger="draftsmith"):
        for _ in range(LOW_WINDOWS + 2):
            drift.observe(*counts.window([0.5, 0.3]))  # 0.8 a step: below 80% of 1.2
    assert drift.below_record
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "below 80% of the head's record (1.20 at k=2" in warnings[0]
    drift.observe(*counts.window([0.8, 0.4]))
    assert not drift.below_record  # recovered: a later slide warns again


def test_a_restarted_engine_starts_a_new_window():
    drift, counts = AcceptanceDrift(RECORD), Counts()
    drift.observe(*counts.window([0.8, 0.4]))
    drift.observe(*counts.window([0.8, 0.4]))
    assert not drift.observe([1, 0], [2, 1])  # counts from zero again: a baseline, not negative rates
    assert drift.observe([1 + 400, 200], [2 + WINDOW_DRAFTS, 1 + WINDOW_DRAFTS])
    assert drift.live == [400 / WINDOW_DRAFTS, 200 / WINDOW_DRAFTS]


def test_metrics_export_the_record_the_live_rates_and_the_flag():
    metrics, counts = ServerMetrics("m", 2, RECORD), Counts()
    for rates in ([0.8, 0.4], [0.7, 0.2], *[[0.3, 0.1]] * LOW_WINDOWS):
        accepted, drafted = counts.window(rates)
        metrics.observe(0, 0, {"accepted_per_position": accepted, "drafted_per_position": drafted})
    text = metrics.render().decode()
    assert 'draftsmith:spec_decode_record_acceptance_rate{model_name="m",position="0"} 0.8' in text
    assert 'draftsmith:spec_decode_live_acceptance_rate{model_name="m",position="1"} 0.1' in text
    assert 'draftsmith:spec_decode_below_record{model_name="m"} 1.0' in text
    assert f'draftsmith:spec_decode_num_draft_tokens_per_pos_total{{model_name="m",position="1"}} ' \
           f"{float(counts.drafted[1])}" in text
    assert "record_acceptance_rate" not in ServerMetrics("m", 2).render().decode()  # no record: no gauges


def test_a_served_head_brings_its_record():
    head = DEMO_MODEL.with_name("demo-code-7m-eagle3")
    spec = parse_speculative_config({"method": "eagle3", "model": str(head), "num_speculative_tokens": 3})
    record = served_record(spec)
    assert record is not None and record.source == "check" and record.k == 5
    assert served_record(parse_speculative_config({"method": "ngram", "num_speculative_tokens": 3})) is None
