"""The Markov head's logit bias rows, kept per previous token. A greedy DSpark chain adds, at each of its k
positions, the bias of the token before it, `markov_w2 @ markov_w1[token]`: a GEMV over the whole vocabulary
that reads all of markov_w2 (2 MB at rank 64 and 8192 tokens), about 70 us a position on a CPU core where the
rest of a position (a row's add and argmax) takes about 10. The bias depends on the token alone, and a code
model's drafts and anchors come back to a few thousand tokens, so rows are computed once and kept (least
recently used out), within a byte budget. Kept or not, a row is the same product (`w1[t] @ w2^T` in the
head's dtype, then fp32, as `MarkovHead` gives it), so what is kept changes no draft beyond the rounding of
GEMMs of other row counts."""

from __future__ import annotations

from collections import OrderedDict

import torch

from draftsmith.models import step_ops_cpu

BUDGET_BYTES = 64 * 2**20  # 2048 rows of an 8192-token vocabulary in fp32


class MarkovBiasRows:
    def __init__(self, markov_w1: torch.Tensor, markov_w2: torch.Tensor, budget_bytes: int = BUDGET_BYTES):
        self.w1, self.w2_t = markov_w1, markov_w2.t()
        vocab = markov_w2.shape[0]
        self.capacity = max(1, min(vocab, budget_bytes // (vocab * 4)))
        # fp32 rows, as the head's logits; untouched rows take no memory until written
        self.table = torch.empty(self.capacity, vocab, dtype=torch.float32, device=markov_w2.device)
        self.where: OrderedDict[int, int] = OrderedDict()  # token -> its row of `table`, least recent first
        # the same map as a tensor for the C++ chain: each token's row of `table`, -1 where it has none
        self.row_of = torch.full((vocab,), -1, dtype=torch.long, device=markov_w2.device)

    def greedy_chain(self, base: torch.Tensor, last: torch.Tensor) -> torch.Tensor | None:
        """Greedy drafts along the block in one C++ op (`step_ops_cpu.markov_chain`): drafted[:, j] the argmax
        of base[:, j] plus the bias of the token before it (`last` for j = 0), as `add_to` then argmax give
        them -> drafted [A, W]; None where the op does not run (not loaded, not fp32) or the rows' tokens at a
        position are more than the budget holds. The op stops where a token has no kept row; that position's
        tokens get theirs (`_rows`) and it goes on. The tokens read count as used (least recently used out)."""
        if base.dtype != torch.float32 or not step_ops_cpu.runs_for(base) or base.dim() != 3 or base.stride(-1) != 1:
            return None
        rows, width = base.shape[:2]
        drafted = torch.empty(rows, width, dtype=torch.long, device=base.device)
        start = 0
        last = last.contiguous()
        while (start := step_ops_cpu.markov_chain(base, self.table, self.row_of, last, drafted, start)) < width:
            if self._rows(last if start == 0 else drafted[:, start - 1]) is None:
                return None
        for token in dict.fromkeys(torch.cat([last[:, None], drafted[:, :-1]], 1).flatten().tolist()):
            if token in self.where:  # a small budget may have let a later position's rows evict it
                self.where.move_to_end(token)
        return drafted

    def add_to(self, logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """logits [A, V] (fp32) plus the bias each of token ids [A] gives the position after it, added in place
        -> logits. A lone row adds its kept row as it lies (no gathered copy: most of a position's cost at one
        request in flight)."""
        rows = self._rows(tokens)
        if rows is None:  # more tokens at once than the budget holds: nothing kept
            return logits.add_(torch.mm(self.w1[tokens], self.w2_t).float())
        if len(rows) == 1:
            return logits.add_(self.table[rows[0]])
        return logits.add_(self.table[torch.tensor(rows, device=tokens.device)])

    def _rows(self, tokens: torch.Tensor) -> list[int] | None:
        """The rows of `table` holding each token's bias, computed for the tokens that had none; None where the
        tokens are more than the budget holds."""
        ids = tokens.tolist()
        distinct = list(dict.fromkeys(ids))
        if len(distinct) > self.capacity:
            return None
        missing = []
        for token in distinct:
            if token in self.where:
                self.where.move_to_end(token)  # so that storing the missing ones evicts none of these
            else:
                missing.append(token)
        if missing:
            biases = torch.mm(self.w1[torch.tensor(missing, device=tokens.device)], self.w2_t).float()
            for token, bias in zip(missing, biases):
                if len(self.where) < self.capacity:
                    row = len(self.where)
                else:
                    evicted, row = self.where.popitem(last=False)
                    self.row_of[evicted] = -1
                self.table[row] = bias
                self.where[token] = row
                self.row_of[token] = row
        return [self.where[t] for t in ids]
