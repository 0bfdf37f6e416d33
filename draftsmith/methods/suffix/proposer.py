"""The suffix decoding proposer: one local tree per running request (its prompt and output) and one global
tree over requests' outputs, kept for the newest `suffix_decoding_max_cached_requests` requests (a request's
output goes in while it runs, as in Arctic). Each row drafts the better-scored of the two trees' proposals
for its newest `max_tree_depth` tokens, up to its limit.

The trees are Python (`tree.py`): a step costs about the depth's worth of dictionary reads per row and per
new token, which is small next to a forward on these targets; memory is reported in the engine's metrics.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch

from draftsmith.methods.proposer_base import DraftBatch, Proposer, RowState
from draftsmith.methods.suffix.tree import Draft, OwnSequence, SuffixTree


class SuffixProposer(Proposer):
    per_token_drafts = False  # one lookup yields every draft
    propose_first = True  # and costs little next to a forward: the policy sees which rows matched

    def __init__(self, config, target, max_num_seqs: int, max_model_len: int):
        super().__init__(config, target, max_num_seqs, max_model_len)
        self.k = config.num_speculative_tokens
        self.depth = config.suffix_decoding_max_tree_depth
        self.max_cached = config.suffix_decoding_max_cached_requests
        self.max_bytes = config.suffix_decoding_max_cache_mb * 2**20
        self.factor = config.suffix_decoding_max_spec_factor
        self.min_prob = config.suffix_decoding_min_token_prob
        self.local: dict[str, OwnSequence] = {}
        self.synced: dict[str, int] = {}  # tokens of the request already in its trees
        self.global_tree = SuffixTree(self.depth)
        self.cached: OrderedDict[str, int] = OrderedDict()  # request id -> sequence id in the global tree
        self._next_seq = 0
        self.draft_tokens = torch.full((max_num_seqs, self.k), -1, dtype=torch.long)
        self.draft_counts = torch.zeros(max_num_seqs, dtype=torch.long)

    def _sync(self, row: RowState) -> None:
        rid = row.request_id
        if rid not in self.local:
            self.local[rid] = own = OwnSequence(self.depth)
            own.extend(row.prompt_token_ids)
            self.synced[rid] = len(row.prompt_token_ids)
            self._cache(rid)
        new = row.output_token_ids[self.synced[rid] - len(row.prompt_token_ids):]
        if new:
            self.local[rid].extend(new)
            if rid in self.cached:
                self.global_tree.extend(self.cached[rid], new)
                self._evict(lambda: self.global_tree.memory_bytes() > self.max_bytes and len(self.cached) > 1)
            self.synced[rid] += len(new)

    def _cache(self, rid: str) -> None:
        """A slot in the global tree for the request's output; the oldest other request gives up its own."""
        if self.max_cached == 0:
            return
        if rid in self.cached:  # a request id used again: its earlier output goes, as in Arctic
            self.global_tree.remove(self.cached.pop(rid))
        self.cached[rid] = self._next_seq
        self._next_seq += 1
        self._evict(lambda: len(self.cached) > self.max_cached)

    def _evict(self, over) -> None:
        """Oldest cached outputs out while `over()` (never the newest: the request that is running)."""
        while over():
            old, seq_id = next(iter(self.cached.items()))
            del self.cached[old]
            self.global_tree.remove(seq_id)

    def propose(self, rows: Sequence[RowState], max_drafts: list[int], sampling=None,
                stop_below: float = 0.0) -> DraftBatch:
        tokens, counts = self.draft_tokens[: len(rows)], self.draft_counts[: len(rows)]
        tokens.fill_(-1)
        for b, (row, limit) in enumerate(zip(rows, max_drafts)):
            self._sync(row)
            draft = self._speculate(row, limit) if limit > 0 else Draft()
            counts[b] = len(draft.tokens)
            if draft.tokens:
                tokens[b, : len(draft.tokens)] = torch.tensor(draft.tokens, dtype=torch.long)
        return DraftBatch(tokens, counts, forwards=1)

    def _speculate(self, row: RowState, limit: int) -> Draft:
        out = row.output_token_ids
        context = out[-self.depth:] if len(out) >= self.depth else \
            row.prompt_token_ids[len(out) - self.depth:] + out
        mine = self.local[row.request_id].speculate(limit, self.factor, 0.0, self.min_prob)
        if not self.cached:
            return mine
        others = self.global_tree.speculate(self.global_tree.match(context), limit, self.factor, 0.0, self.min_prob)
        return mine if mine.score >= others.score else others

    def release(self, request: RowState) -> None:
        if request.request_id in self.local:
            self._sync(request)  # the output's last tokens, for later requests
            del self.local[request.request_id], self.synced[request.request_id]

    def forget(self) -> None:
        """Empties the global tree; running requests' outputs leave it too, as if evicted."""
        self.global_tree = SuffixTree(self.depth)
        self.cached.clear()

    def metrics(self) -> dict:
        return {"suffix_cache_nodes": self.global_tree.num_nodes,
                "suffix_cache_bytes": self.global_tree.memory_bytes() + sum(o.memory_bytes() for o in self.local.values()),
                "suffix_cached_requests": len(self.cached)}
