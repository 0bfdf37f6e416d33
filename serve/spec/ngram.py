"""N-gram (prompt lookup) proposer, vectorized over the batch.

For each row, find the longest suffix n-gram (prompt_lookup_min <= n <= prompt_lookup_max) that occurred
earlier in prompt + output; on ties the earliest occurrence wins (vLLM's rule); propose the tokens that
followed it. Token histories live in one `[slots, max_model_len]` buffer, appended to incrementally, so a
step costs a few tensor compares, not a Python scan of every history.
"""

from __future__ import annotations

import torch

from draftsmith.serve.request import Request
from draftsmith.serve.spec.proposer import Drafts, Proposer
from draftsmith.serve.spec.registry import register_proposer


@register_proposer("ngram")
class NgramProposer(Proposer):
    def __init__(self, config, target, max_num_seqs: int, max_model_len: int):
        super().__init__(config, target, max_num_seqs, max_model_len)
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max
        self.tokens = torch.zeros(max_num_seqs, max_model_len, dtype=torch.long)
        self.synced = [0] * max_num_seqs  # tokens of the slot's request already in the buffer
        self.owner: list[str | None] = [None] * max_num_seqs

    def _sync(self, request: Request) -> None:
        slot = request.slot
        if self.owner[slot] != request.request_id:
            self.owner[slot], self.synced[slot] = request.request_id, 0
        history = request.all_token_ids() if self.synced[slot] == 0 else request.output_token_ids[
            self.synced[slot] - request.prompt_len:]
        if history:
            self.tokens[slot, self.synced[slot] : request.num_tokens] = torch.tensor(history, dtype=torch.long)
        self.synced[slot] = request.num_tokens

    def propose(self, rows: list[Request], max_drafts: list[int]) -> Drafts:
        for request in rows:
            self._sync(request)
        width = max(r.num_tokens for r in rows)
        starts = find_continuations(self.tokens[[r.slot for r in rows], :width],
                                    torch.tensor([r.num_tokens for r in rows]), self.min_n, self.max_n).tolist()
        drafts = []
        for request, start, limit in zip(rows, starts, max_drafts):
            end = min(start + limit, request.num_tokens)
            drafts.append(self.tokens[request.slot, start:end].tolist() if start >= 0 and limit > 0 else [])
        return Drafts(drafts)

    def release(self, request: Request) -> None:
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
