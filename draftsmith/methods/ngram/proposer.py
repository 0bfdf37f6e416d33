"""N-gram (prompt lookup) proposer, vectorized over the batch.

For each row, find the longest suffix n-gram (prompt_lookup_min <= n <= prompt_lookup_max) that occurred
earlier in prompt + output; on ties the earliest occurrence wins (vLLM's rule); propose the tokens that
followed it. Token histories live in one `[slots, max_model_len]` buffer, appended to incrementally, so a
step costs a few tensor compares, not a Python scan of every history; drafts are gathered from it with
one indexed read into the persistent draft buffer.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from draftsmith.methods.base import DraftBatch, Proposer, RowState


class NgramProposer(Proposer):
    sequential = False  # one lookup yields every draft
    propose_first = True  # and costs little next to a forward: the planner sees which rows matched

    def __init__(self, config, target, max_num_seqs: int, max_model_len: int):
        super().__init__(config, target, max_num_seqs, max_model_len)
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max
        self.k = config.num_speculative_tokens
        self.tokens = torch.zeros(max_num_seqs, max_model_len, dtype=torch.long)
        self.synced = [0] * max_num_seqs  # tokens of the slot's request already in the buffer
        self.owner: list[str | None] = [None] * max_num_seqs
        self.draft_tokens = torch.full((max_num_seqs, self.k), -1, dtype=torch.long)
        self.draft_counts = torch.zeros(max_num_seqs, dtype=torch.long)

    def _sync(self, request: RowState) -> None:
        slot = request.slot
        if self.owner[slot] != request.request_id:
            self.owner[slot], self.synced[slot] = request.request_id, 0
        prompt_len = len(request.prompt_token_ids)
        history = request.all_token_ids() if self.synced[slot] == 0 else request.output_token_ids[
            self.synced[slot] - prompt_len:]
        if history:
            self.tokens[slot, self.synced[slot] : request.num_tokens] = torch.tensor(history, dtype=torch.long)
        self.synced[slot] = request.num_tokens

    def propose(self, rows: Sequence[RowState], max_drafts: list[int], sampling=None) -> DraftBatch:
        for request in rows:
            self._sync(request)
        rows_n = len(rows)
        slots = torch.tensor([r.slot for r in rows])
        lengths = torch.tensor([r.num_tokens for r in rows])
        width = int(lengths.max())
        starts = find_continuations(self.tokens[slots, :width], lengths, self.min_n, self.max_n)  # [B]
        limits = torch.tensor(max_drafts, dtype=torch.long)
        # a continuation may run up to the end of the history (it may overlap the suffix itself)
        counts = torch.where(starts >= 0, torch.minimum(limits, lengths - starts), torch.zeros_like(limits))
        counts = counts.clamp(min=0)
        offsets = torch.arange(self.k)
        index = (starts.clamp(min=0)[:, None] + offsets[None, :]).clamp(max=self.tokens.shape[1] - 1)
        drafted = self.tokens[slots[:, None], index]
        tokens, out_counts = self.draft_tokens[:rows_n], self.draft_counts[:rows_n]
        tokens.copy_(torch.where(offsets[None, :] < counts[:, None], drafted, torch.full_like(drafted, -1)))
        out_counts.copy_(counts)
        self.steps_run = 1
        return DraftBatch(tokens, out_counts)

    def release(self, request: RowState) -> None:
        if request.slot is not None and self.owner[request.slot] == request.request_id:
            self.owner[request.slot] = None


def find_continuations(tokens: torch.Tensor, lengths: torch.Tensor, min_n: int, max_n: int) -> torch.Tensor:
    """tokens [B, L] (row b valid up to lengths[b]) -> index [B] where the proposal starts, -1 if no match."""
    rows, width = tokens.shape
    best = torch.full((rows,), -1, dtype=torch.long)
    for n in range(max_n, min_n - 1, -1):  # longest n first; a longer match is never replaced
        if width < n + 1:
            continue
        windows = tokens[:, :width].unfold(1, n, 1)  # [B, width - n + 1, n]
        suffix_index = (lengths[:, None] - n + torch.arange(n)[None, :]).clamp(min=0)
        suffix = tokens.gather(1, suffix_index)  # [B, n]
        match = (windows == suffix[:, None, :]).all(-1)
        # a match may overlap the suffix but must be followed by a token to propose (this excludes the suffix)
        window_start = torch.arange(windows.shape[1])[None, :]
        match &= (window_start + n < lengths[:, None]) & (lengths[:, None] > n)
        found = match.any(1) & (best < 0)
        first = match.to(torch.int8).argmax(1)  # earliest occurrence
        best = torch.where(found, first + n, best)
    return best
