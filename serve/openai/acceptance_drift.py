"""Live drift: a served head's acceptance per draft position over its newest drafts, beside its record
(`draftsmith.acceptance_record`), with a warning in the log while the live figure stays below the share of
the record that `draftsmith check` holds the head to. What users see after an engine upgrade, a re-quantized
target or a converter slip: a head that loads and accepts less than it did.

Live traffic is not the record's text, and sampled requests accept less than greedy ones, so the warning
waits for several windows in a row; the figures are on /metrics either way."""

from __future__ import annotations

import logging
from pathlib import Path

from draftsmith.acceptance_record import Acceptance, read_record
from draftsmith.serve.check.gate import RECORD_SHARE

logger = logging.getLogger("draftsmith")

WINDOW_DRAFTS = 500  # live rates are over about the newest this many drafts
LOW_WINDOWS = 3  # windows in a row below the record before the warning


def served_record(spec_config) -> Acceptance | None:
    """The record of the head a speculative config serves, where its model is a directory holding one."""
    model = getattr(spec_config, "model", None)
    return read_record(Path(model)) if model and Path(model).is_dir() else None


class AcceptanceDrift:
    """Fed the engine's cumulative accepted and drafted counts per position (`observe`); each time a window
    of WINDOW_DRAFTS drafts closes, its rates are the live figure."""

    def __init__(self, record: Acceptance):
        self.record, self.share = record, RECORD_SHARE[record.source]
        self.live: list[float] = []
        self.low_windows = 0
        self._start: tuple[list[int], list[int]] | None = None  # the counts where the open window began

    @property
    def below_record(self) -> bool:
        return self.low_windows >= LOW_WINDOWS

    def observe(self, accepted: list[int], drafted: list[int]) -> bool:
        """Takes the newest counts; True when they closed a window (and `live` changed)."""
        if self._start is None or not drafted or drafted[0] < self._start[1][0]:  # first, or a restarted engine
            self._start = (list(accepted), list(drafted))
            return False
        start_accepted, start_drafted = self._start
        window = [d - s for d, s in zip(drafted, start_drafted)]
        if window[0] < WINDOW_DRAFTS:
            return False
        self.live = [(a - s) / d if d else 0.0 for a, s, d in zip(accepted, start_accepted, window)]
        self._start = (list(accepted), list(drafted))
        self._judge()
        return True

    def _judge(self) -> None:
        k = min(self.record.k, len(self.live))
        live, want = sum(self.live[:k]), self.share * self.record.gain(k)
        was_below = self.below_record
        self.low_windows = self.low_windows + 1 if live < want else 0
        if self.below_record and not was_below:
            logger.warning("speculation accepts %.2f drafts a step over the last %d windows of %d drafts, below "
                           "%.0f%% of the head's record (%.2f at k=%d, %s): see `draftsmith check`",
                           live, LOW_WINDOWS, WINDOW_DRAFTS, 100 * self.share, self.record.gain(k), k,
                           self.record.measured_on or self.record.source)
