"""Medusa proposer: every head reads the target's final normed hidden state at the row's last verified
position, all in one pass, and drafts its argmax, or samples from its distribution (a chain). Head i's
distribution does not depend on the drafts before it, so it is the q the rejection sampler needs as it is.
With a `speculative_token_tree`, the node at path (r1, ..., rd) is head d's rank-rd token: Medusa's candidate
tree, built from each head's top-k in the same one pass."""

from __future__ import annotations

import torch

from draftsmith.methods.last_hidden import LastHiddenProposer


class MedusaProposer(LastHiddenProposer):
    sequential = False  # one pass over the heads yields every draft

    def __init__(self, config, target, max_num_seqs: int, max_model_len: int):
        super().__init__(config, target, max_num_seqs, max_model_len)
        # a static TokenTree, whose parents go with every propose (LastHiddenProposer); its depth is checked
        # against the heads at load
        self.tree = config.token_tree()
        if self.tree is not None:
            self._depths = torch.tensor(self.tree.depths, device=self.device) - 1
            self._ranks = torch.tensor(self.tree.ranks, device=self.device)

    def _draft(self, rows, hidden, width):
        self.steps_run = 1
        if self.tree is not None:  # the first `width` nodes: parents come first, so they are a tree
            depth = self.tree.depths[width - 1]
            logits = self.head(hidden, heads=depth)  # [n, depth, V]
            top = logits.topk(min(self.tree.top_k, logits.shape[-1]), dim=-1).indices  # [n, depth, k]
            return top[:, self._depths[:width], self._ranks[:width]]
        logits = self.head(hidden, heads=width)  # [n, width, V]
        return torch.stack([self._pick(logits[:, i]) for i in range(width)], dim=1)
