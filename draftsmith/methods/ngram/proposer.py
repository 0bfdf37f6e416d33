"""N-gram (prompt lookup) proposer, vectorized over the batch.

For each row, find the longest suffix n-gram (prompt_lookup_min <= n <= prompt_lookup_max) that occurred
earlier in prompt + output, and propose the tokens that followed its most recent occurrence. vLLM takes the
earliest; code repeats itself locally (the same call again, the loop body of a few lines up), and on the
house model's greedy continuations of the 179 validation prompts the most recent occurrence's drafts were
accepted 69% of the time against 60%, with 4% fewer steps for the same tokens (k = 4, n = 2..4).

Token histories live in one `[slots, max_model_len]` buffer, appended to incrementally, so a step costs a
few tensor compares, not a Python scan of every history; drafts are gathered from it with one indexed read
into the persistent draft buffer. Where the engine loaded its CPU build, one C++ op does the lookup and the
gather for the batch (`models/ngram_lookup_cpu.cpp`: some forty small tensor ops took 0.46 ms a propose).

Each row's drafts carry their confidence, from how long the match was (`calibration`), so that in a busy
batch the engine verifies only the drafts likely enough to pay.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from draftsmith.methods.ngram.calibration import AGREE_CAP, MatchCalibration
from draftsmith.methods.proposer_base import DraftBatch, Proposer, RowState
from draftsmith.models import step_ops_cpu


class NgramProposer(Proposer):
    per_token_drafts = False  # one lookup yields every draft
    propose_first = True  # and costs little next to a forward: the policy sees which rows matched

    def __init__(self, config, target, max_num_seqs: int, max_model_len: int):
        super().__init__(config, target, max_num_seqs, max_model_len)
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max
        self.k = config.num_speculative_tokens
        self.tokens = torch.zeros(max_num_seqs, max_model_len, dtype=torch.long)
        self.synced = [0] * max_num_seqs  # tokens of the slot's request already in the buffer
        self.owner: list[str | None] = [None] * max_num_seqs
        self.draft_tokens = torch.full((max_num_seqs, self.k), -1, dtype=torch.long)
        self.draft_counts = torch.zeros(max_num_seqs, dtype=torch.long)
        self.agreed = torch.zeros(max_num_seqs, dtype=torch.long)  # each row's match length, 0: none
        self.confidence = torch.zeros(max_num_seqs, self.k)
        self.calibration = MatchCalibration(self.k, max_num_seqs)
        self.agree_cap = max(AGREE_CAP, self.max_n)

    def _sync(self, request: RowState) -> None:
        slot = request.slot
        if self.owner[slot] != request.request_id:
            self.owner[slot], self.synced[slot] = request.request_id, 0
            self.calibration.forget(slot)
        prompt_len = len(request.prompt_token_ids)
        history = request.all_token_ids() if self.synced[slot] == 0 else request.output_token_ids[
            self.synced[slot] - prompt_len:]
        self.calibration.settle(slot, self.synced[slot], history)
        if history:
            self.tokens[slot, self.synced[slot] : request.num_tokens] = torch.tensor(history, dtype=torch.long)
        self.synced[slot] = request.num_tokens

    def propose(self, rows: Sequence[RowState], max_drafts: list[int], sampling=None,
                stop_below: float = 0.0) -> DraftBatch:
        for request in rows:
            self._sync(request)
        rows_n = len(rows)
        slots = torch.tensor([r.slot for r in rows])
        lengths = torch.tensor([r.num_tokens for r in rows])
        limits = torch.as_tensor(max_drafts, dtype=torch.long)
        tokens, out_counts, agreed = self.draft_tokens[:rows_n], self.draft_counts[:rows_n], self.agreed[:rows_n]
        if step_ops_cpu.enabled():
            torch.ops.draftsmith_cpu.ngram_propose.default(self.tokens, slots, lengths, limits, self.min_n,
                                                           self.max_n, self.agree_cap, tokens, out_counts, agreed)
        else:
            self._lookup(slots, lengths, limits, tokens, out_counts, agreed)
        return DraftBatch(tokens, out_counts, confidence=self._confidence(rows, tokens, agreed), forwards=1)

    def _confidence(self, rows: Sequence[RowState], tokens: torch.Tensor, agreed: torch.Tensor) -> torch.Tensor:
        """[B, k] the calibrated chance that each row's drafts 0..j are all accepted; remembers the proposals
        to learn from once the rows go on."""
        matched = agreed.tolist()
        for row, n, drafted in zip(rows, matched, tokens.tolist()):
            self.calibration.remember(row.slot, row.num_tokens, n, [t for t in drafted if t >= 0])
        confidence = self.confidence[: len(rows)]
        confidence.copy_(torch.tensor(self.calibration.survival(matched)))
        return confidence

    def _lookup(self, slots, lengths, limits, tokens, out_counts, agreed) -> None:
        """The C++ op's lookup in tensor ops, into the same buffers."""
        width = int(lengths.max())
        history = self.tokens[slots, :width]
        starts = find_continuations(history, lengths, self.min_n, self.max_n)  # [B]
        # a continuation may run up to the end of the history (it may overlap the suffix itself)
        counts = torch.where(starts >= 0, torch.minimum(limits, lengths - starts), torch.zeros_like(limits))
        counts = counts.clamp(min=0)
        offsets = torch.arange(self.k)
        index = (starts.clamp(min=0)[:, None] + offsets[None, :]).clamp(max=self.tokens.shape[1] - 1)
        drafted = self.tokens[slots[:, None], index]
        tokens.copy_(torch.where(offsets[None, :] < counts[:, None], drafted, torch.full_like(drafted, -1)))
        out_counts.copy_(counts)
        agreed.copy_(match_lengths(history, lengths, starts, self.agree_cap))

    def forget(self) -> None:
        self.calibration = MatchCalibration(self.k, len(self.owner))

    def release(self, request: RowState) -> None:
        if request.slot is not None and self.owner[request.slot] == request.request_id:
            self.owner[request.slot] = None
            self.calibration.forget(request.slot)


def match_lengths(tokens: torch.Tensor, lengths: torch.Tensor, starts: torch.Tensor, cap: int) -> torch.Tensor:
    """[B] how many tokens before each row's proposal start equal the row's last ones, up to `cap` (at least
    the n that matched; 0 where nothing did: start -1)."""
    back = torch.arange(cap)[None, :]
    before, last = starts[:, None] - 1 - back, lengths[:, None] - 1 - back  # compared pairs, newest first
    inside = (before >= 0) & (starts[:, None] > 0)
    equal = inside & (tokens.gather(1, before.clamp(min=0)) == tokens.gather(1, last.clamp(min=0)))
    return equal.long().cumprod(1).sum(1)


def find_continuations(tokens: torch.Tensor, lengths: torch.Tensor, min_n: int, max_n: int) -> torch.Tensor:
    """tokens [B, L] (row b valid up to lengths[b]) -> index [B] where the proposal starts, -1 if no match.

    Matches are indexed by the position p where they end: an n-gram ending at p equals the history's last n
    tokens iff the (n-1)-gram ending there does and token p - n + 1 equals the suffix's first. So each longer
    n costs one more compare of the history, not a new unfold of [B, L, n] (8 rows x 1100 tokens: 141 us
    against 339)."""
    rows, width = tokens.shape
    best = torch.full((rows,), -1, dtype=torch.long)
    if width < 2:
        return best
    ends = torch.arange(width)[None, :]
    after = ends + 1  # where the proposal starts for a match ending at p; 0 below means no match
    # an end p must leave a token to propose (p + 1 < length), so the history's own suffix never matches
    followed = ends + 1 < lengths[:, None]
    matched = torch.ones(rows, width, dtype=torch.bool)  # the n-gram ending at p matches, for n so far
    last = (lengths - 1).clamp(min=0)
    for n in range(1, max_n + 1):
        if width < n + 1:
            break
        # token p - (n - 1) against the suffix token n - 1 from the end; no n-gram ends before n - 1
        suffix_token = tokens.gather(1, (last - (n - 1)).clamp(min=0)[:, None])
        matched[:, n - 1 :] &= tokens[:, : width - n + 1] == suffix_token
        if n > 1:
            matched[:, n - 2] = False
        if n < min_n:
            continue
        newest = torch.where(matched & followed, after, 0).amax(1)  # the most recent occurrence
        best = torch.where((newest > 0) & (lengths > n), newest, best)  # a longer n, later, wins
    return best
