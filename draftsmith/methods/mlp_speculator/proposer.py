"""MLP speculator proposer: stage i drafts from the running state and the token before it (the row's
newest token for stage 0, then each stage's draft, greedy or sampled), all rows at once, one small MLP per
draft."""

from __future__ import annotations

import torch

from draftsmith.methods.last_hidden import LastHiddenProposer


class MLPSpeculatorProposer(LastHiddenProposer):
    def _draft(self, rows, hidden, width):
        tokens = torch.tensor([r.output_token_ids[-1] for r in rows], device=self.device)
        state, drafts = self.head.start(hidden), []
        for i in range(width):
            state, logits = self.head.stage(i, state, tokens)
            tokens = self._pick(logits)
            drafts.append(tokens)
        return torch.stack(drafts, dim=1)
