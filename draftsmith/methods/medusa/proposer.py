"""Medusa proposer: every head reads the target's final normed hidden state at the row's last verified
position, all in one pass, and drafts its argmax, or samples from its distribution (a chain; candidate trees
come with tree verification). Head i's distribution does not depend on the drafts before it, so it is the q
the rejection sampler needs as it is."""

from __future__ import annotations

import torch

from draftsmith.methods.last_hidden import LastHiddenProposer


class MedusaProposer(LastHiddenProposer):
    sequential = False  # one pass over the heads yields every draft

    def _draft(self, rows, hidden, width):
        self.steps_run = 1
        logits = self.head(hidden, heads=width)  # [n, width, V]
        return torch.stack([self._pick(logits[:, i]) for i in range(width)], dim=1)
