"""Medusa proposer: every head reads the target's final normed hidden state at the row's last verified
position, all in one pass, and drafts its argmax, or samples from its distribution (a chain). Head i's
distribution does not depend on the drafts before it, so it is the q the rejection sampler needs as it is.
With a `speculative_token_tree`, the node at path (r1, ..., rd) is head d's rank-rd token: Medusa's candidate
tree, built from each head's top-k in the same one pass."""

from __future__ import annotations

import torch

from draftsmith.methods.draft_trees import static_marginal_tree
from draftsmith.methods.last_hidden import LastHiddenProposer
from draftsmith.models import step_ops_cpu


class MedusaProposer(LastHiddenProposer):
    per_token_drafts = True  # the heads run in one pass, but each draft is one more head (an LM head each)

    def __init__(self, config, target, max_num_seqs: int, max_model_len: int):
        super().__init__(config, target, max_num_seqs, max_model_len)
        # a static TokenTree, whose parents go with every propose (LastHiddenProposer); its depth is checked
        # against the heads at load
        self.tree = config.token_tree()

    def _draft(self, rows, hidden, width):
        if self.tree is not None:  # the first `width` nodes: parents come first, so they are a tree
            depth = self.tree.depths[width - 1]
            return static_marginal_tree(self.head(hidden, heads=depth), self.tree, width)
        logits = self.head(hidden, heads=width)  # [n, width, V]
        if self._sampling is None:  # greedy: every head's argmax at once
            return step_ops_cpu.argmax_ids(logits)
        return torch.stack([self._pick(logits[:, i]) for i in range(width)], dim=1)
