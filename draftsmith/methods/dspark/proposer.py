"""The DSpark proposer: DFlash's (one block forward over the context it keeps per slot), then the Markov term
applied along the block: draft j is chosen from the block's logits at position j plus the bias of draft j - 1
(of the row's last token for j = 0), greedy or sampled, and that choice is what draft j + 1 conditions on.
q of a sampled draft is the distribution it was drawn from, given the drafts before it, as a chain drafter's
must be for rejection sampling. With `enable_adaptive_verification` the confidence head's chances, multiplied
along each chain, go back with the drafts (`DraftBatch.confidence`), and the engine cuts each row's verify
where the cost model says the rest does not pay (`serve.speculation.verify_length`)."""

from __future__ import annotations

import torch

from draftsmith.methods.dflash.proposer import DFlashProposer
from draftsmith.methods.draft_sampling import choose
from draftsmith.methods.dspark.markov_cache import MarkovBiasRows


class DSparkProposer(DFlashProposer):
    def __init__(self, config, target, max_num_seqs: int, max_model_len: int):
        super().__init__(config, target, max_num_seqs, max_model_len)
        self.adaptive_verification = config.enable_adaptive_verification and self.head.confidence_head is not None
        self.survival = torch.zeros(max_num_seqs, self.k, device=self.device)
        self.bias_rows: MarkovBiasRows | None = None  # made on the first greedy chain

    def _chain(self, hidden: torch.Tensor, last: torch.Tensor, limits: list[int], rows: torch.Tensor,
               temperature: torch.Tensor | None, generators: dict[int, torch.Generator], tokens_out: torch.Tensor,
               probs_out: torch.Tensor | None) -> torch.Tensor | None:
        base = self.readout(hidden)  # [A, width, V]
        width = base.shape[1]
        limit = torch.tensor(limits, device=self.device)
        kept = torch.arange(width, device=self.device) < limit[:, None]
        greedy = self._greedy_chain(base, hidden, last) if temperature is None else None
        if greedy is not None:
            drafted, embedded = greedy
        else:
            drafted, embedded = self._along_block(base, hidden, last, limits, rows, temperature, generators,
                                                  probs_out)
        tokens_out[rows, :width] = torch.where(kept, drafted, -1)
        if not self.adaptive_verification:
            return None
        chances = torch.sigmoid(self.head.confidence_logits(hidden, embedded))
        survival = self.survival[: tokens_out.shape[0]]
        survival.zero_()
        survival[rows, :width] = chances.cumprod(-1) * kept
        return survival

    def _bias_adder(self):
        """add(logits [A, V] fp32, token ids [A], the positions' hidden states [A, H]) -> the logits plus the
        Markov bias of each row's token, added in place (None: no Markov head). On a CPU a vanilla head's row
        of each token is kept once computed (`MarkovBiasRows`: the vocabulary-wide GEMV was most of a chain
        position's cost); a GPU's GEMV is cheap, and kept rows would sync on every token. A gated head's bias
        depends on the hidden state too, so it is computed at every position."""
        markov = self.head.markov_head
        if markov is None:
            return None
        if self.device.type != "cpu" or markov.gated:
            return lambda logits, tokens, hidden: logits.add_(markov(tokens, hidden)[1])
        if self.bias_rows is None:
            self.bias_rows = MarkovBiasRows(markov.markov_w1.weight, markov.markov_w2.weight)
        return lambda logits, tokens, hidden: self.bias_rows.add_to(logits, tokens)

    def _embedded(self, before: list[torch.Tensor]) -> torch.Tensor | None:
        """The Markov embeddings [A, width, r] of the tokens before each block position (what the confidence
        head reads), None without a Markov head."""
        markov = self.head.markov_head
        return markov.embed(torch.stack(before, 1)) if markov is not None else None

    def _greedy_chain(self, base: torch.Tensor, hidden: torch.Tensor, last: torch.Tensor):
        """Greedy drafts along the block, each the argmax of the block's logits plus the Markov bias of the
        draft before it -> (drafts [A, width], `_embedded`): `_along_block`'s choices in fewer ops a position,
        and on a CPU with kept bias rows in one C++ op for the block (a position's dozen small ops and host
        lookups had cost about 70 us, most of the chain at one row)."""
        add_bias = self._bias_adder()
        if add_bias is None:
            return None
        if self.bias_rows is not None and (chained := self.bias_rows.greedy_chain(base, last)) is not None:
            return chained, self.head.markov_head.embed(torch.cat([last[:, None], chained[:, :-1]], 1))
        previous, before, drafted = last, [], []
        for j in range(base.shape[1]):  # base is the chain's own: its positions take their bias in place
            before.append(previous)
            previous = add_bias(base[:, j], previous, hidden[:, j]).argmax(-1)
            drafted.append(previous)
        return torch.stack(drafted, 1), self._embedded(before)

    def _along_block(self, base, hidden, last, limits, rows, temperature, generators, probs_out):
        """Drafts chosen left to right over the whole vocabulary, each position's logits gaining the Markov
        bias of the draft before it -> (drafts [A, width], `_embedded`)."""
        width = base.shape[1]
        add_bias = self._bias_adder()
        previous, before = last, []
        drafted = torch.full(base.shape[:2], -1, dtype=torch.long, device=self.device)
        for j in range(width):
            before.append(previous)
            logits = add_bias(base[:, j], previous, hidden[:, j]) if add_bias is not None else base[:, j]
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
        return drafted, self._embedded(before)
