"""The DSpark proposer: DFlash's (one block forward over the context it keeps per slot), then the Markov term
applied along the block: draft j is chosen from the block's logits at position j plus the bias of draft j - 1
(of the row's last token for j = 0), greedy or sampled, and that choice is what draft j + 1 conditions on.
q of a sampled draft is the distribution it was drawn from, given the drafts before it, as a chain drafter's
must be for rejection sampling. With `enable_adaptive_verification` the confidence head's chances, multiplied
along each chain, go back with the drafts (`DraftBatch.confidence`), and the engine cuts each row's verify
where the cost model says the rest does not pay (`serve.speculation.verify_length`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from draftsmith.methods.dflash.proposer import DFlashProposer
from draftsmith.methods.draft_sampling import choose


class DSparkProposer(DFlashProposer):
    def __init__(self, config, target, max_num_seqs: int, max_model_len: int):
        super().__init__(config, target, max_num_seqs, max_model_len)
        self.adaptive_verification = config.enable_adaptive_verification and self.head.confidence_head is not None
        self.survival = torch.zeros(max_num_seqs, self.k, device=self.device)

    def _chain(self, hidden: torch.Tensor, last: torch.Tensor, limits: list[int], rows: torch.Tensor,
               temperature: torch.Tensor | None, generators: dict[int, torch.Generator], tokens_out: torch.Tensor,
               probs_out: torch.Tensor | None) -> torch.Tensor | None:
        base = self.head.readout(hidden)  # [A, width, V]
        width = base.shape[1]
        limit = torch.tensor(limits, device=self.device)
        kept = torch.arange(width, device=self.device) < limit[:, None]
        greedy = self._greedy_chain(base, last) if temperature is None else None
        if greedy is not None:
            drafted, embedded = greedy
        else:
            drafted, embedded = self._along_block(base, last, limits, rows, temperature, generators, probs_out)
        tokens_out[rows, :width] = torch.where(kept, drafted, -1)
        if not self.adaptive_verification:
            return None
        markov = torch.stack(embedded, 1) if embedded[0] is not None else None
        chances = torch.sigmoid(self.head.confidence_logits(hidden, markov))
        survival = self.survival[: tokens_out.shape[0]]
        survival.zero_()
        survival[rows, :width] = chances.cumprod(-1) * kept
        return survival

    def _greedy_chain(self, base: torch.Tensor, last: torch.Tensor):
        """Greedy drafts along the block, each the argmax of the block's logits plus the Markov bias of the
        draft before it -> (drafts [A, width], Markov embeddings per position): `_along_block`'s choices in
        fewer ops a position (the bias added inside its GEMV), which at one row are most of a draft's cost; in
        fp32, where the two round alike but for addmm's fused add (a near-tie may go the other way)."""
        markov = self.head.markov_head
        if markov is None or markov.markov_w2.weight.dtype != torch.float32:
            return None  # a head drafting in bf16 rounds its bias there, as `_along_block` and training do
        w1, w2_t = markov.markov_w1.weight, markov.markov_w2.weight.t()
        previous, embedded, drafted = last, [], []
        for j in range(base.shape[1]):
            e = F.embedding(previous, w1)  # [A, r]
            drafted.append(torch.addmm(base[:, j], e, w2_t).argmax(-1))
            embedded.append(e)
            previous = drafted[-1]
        return torch.stack(drafted, 1), embedded

    def _along_block(self, base, last, limits, rows, temperature, generators, probs_out):
        """Drafts chosen left to right over the whole vocabulary, each position's logits gaining the Markov
        bias of the draft before it -> (drafts [A, width], Markov embeddings per position)."""
        width = base.shape[1]
        previous, embedded = last, []
        drafted = torch.full(base.shape[:2], -1, dtype=torch.long, device=self.device)
        for j in range(width):
            markov_embedding, bias = self.head.markov(previous)
            embedded.append(markov_embedding)
            logits = base[:, j] + bias
            if temperature is None:
                drafted[:, j] = logits.argmax(-1)
            else:  # only the rows that keep draft j draw it: a seeded row's draws do not depend on its batch
                live = [i for i, n in enumerate(limits) if n > j]
                live_t = torch.tensor(live, device=self.device)
                draws = [(i, generators[r]) for i, r in enumerate(live) if r in generators]
                drawn, _, q = choose(logits[live_t], temperature[live_t], draws)
                drafted[live_t, j] = drawn
                if probs_out is not None:
                    probs_out[rows[live_t], j] = q
            previous = drafted[:, j].clamp(min=0)  # rows past their limit draft nothing more that is read
        return drafted, embedded
