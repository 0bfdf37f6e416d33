"""Medusa proposer: every head reads the target's final normed hidden state at the row's last verified
position, all in one pass, and drafts its argmax (a top-1 chain; candidate trees come with tree
verification)."""

from __future__ import annotations

from draftsmith.methods.last_hidden import LastHiddenProposer


class MedusaProposer(LastHiddenProposer):
    sequential = False  # one pass over the heads yields every draft

    def _draft(self, rows, hidden, width):
        self.steps_run = 1
        return self.head(hidden, heads=width).argmax(-1)
