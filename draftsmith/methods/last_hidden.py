"""What proposers whose head reads only the target's final normed hidden state at the last verified position
share (Medusa, MLP speculator): the head loaded and attached, that one hidden state kept per slot and
replaced by each forward's newest, the draft buffers, and choosing each draft from logits (greedy, or
sampled with its q reported). A subclass drafts from them (`_draft`, choosing with `_pick`).

A plain step the policy holds hands its hidden states over by reference (`observe_later`): only each slot's
newest is ever read, so they are copied in when drafting or another observe needs them, the newest per slot
only (the copy every held step made was 0.8% of a held Medusa step's time at one in flight)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from draftsmith.methods.draft_sampling import choose
from draftsmith.methods.heads import load_attached_head
from draftsmith.methods.proposer_base import DraftBatch, DraftSampling, Proposer, RowState

# held steps kept by reference before the newest of each slot is copied in anyway: bounds what they keep alive
MAX_LATER = 64


class LastHiddenProposer(Proposer):
    def __init__(self, config, target, max_num_seqs: int, max_model_len: int):
        super().__init__(config, target, max_num_seqs, max_model_len)
        weight = target.model.embed_tokens.weight
        # the target's dtype: heads without LM heads of their own read out through the target's
        self.head = load_attached_head(config, target, weight.dtype)
        self.k = config.num_speculative_tokens
        self.feature_layers = self.head.feature_layers
        self.observe_window = 1  # only the newest position's hidden state is ever read
        self.device = weight.device
        self.last = torch.zeros(max_num_seqs, target.config.hidden_size, dtype=weight.dtype, device=self.device)
        self.draft_tokens = torch.full((max_num_seqs, self.k), -1, dtype=torch.long, device=self.device)
        self.draft_counts = torch.zeros(max_num_seqs, dtype=torch.long, device=self.device)
        self.draft_probs: torch.Tensor | None = None  # [max_num_seqs, k, V], allocated on first sampled draft
        self._sampling: tuple[torch.Tensor, list] | None = None  # this propose's (temperatures, draws)
        self._qs: list[torch.Tensor] = []
        self._later: list[tuple[list[int], dict[int, torch.Tensor]]] = []  # held steps: (slots, hidden states)

    def draft_models(self) -> list[torch.nn.Module]:
        return [self.head]

    def features(self, hidden_states):
        return self.head.features(hidden_states)

    def observe(self, rows: Sequence[RowState], starts: list[int], counts: list[int], features: torch.Tensor) -> None:
        self._take_later()
        if max(counts) == 1:
            newest = features[:, 0]
        else:
            newest = features[torch.arange(len(rows), device=self.device),
                              torch.tensor(counts, device=self.device) - 1]
        self._keep_newest([r.slot for r in rows], newest)

    def observe_later(self, rows: Sequence[RowState], starts: list[int], hidden_states) -> bool:
        self._later.append(([r.slot for r in rows], hidden_states))
        if len(self._later) >= MAX_LATER:
            self._take_later()
        return True

    @torch.inference_mode()
    def _take_later(self) -> None:
        """Copies in the newest held step's hidden state of each slot that one was kept for."""
        if not self._later:
            return
        later, self._later, seen = self._later, [], set()
        for slots, hidden_states in reversed(later):
            index = [i for i, slot in enumerate(slots) if slot not in seen]
            if not index:
                continue
            seen.update(slots)
            newest = self.features(hidden_states)[:, 0]
            if len(index) < len(slots):
                newest = newest[torch.tensor(index, device=self.device)]
            self._keep_newest([slots[i] for i in index], newest)

    def _keep_newest(self, slots: list[int], newest: torch.Tensor) -> None:
        """newest [n, H]: slots[i]'s newest hidden state. Rows in consecutive slots (the engine's usual order)
        are one slice copy, with no index tensor built (they were 2% of a plain step)."""
        if slots == list(range(slots[0], slots[0] + len(slots))):
            self.last[slots[0] : slots[0] + len(slots)] = newest
        else:
            self.last[torch.tensor(slots, device=self.device)] = newest

    @torch.inference_mode()
    def propose(self, rows: Sequence[RowState], max_drafts: list[int], sampling: DraftSampling | None = None,
                stop_below: float = 0.0) -> DraftBatch:
        n = len(rows)
        tokens, counts = self.draft_tokens[:n], self.draft_counts[:n]
        tokens.fill_(-1)
        width = min(max(max_drafts, default=0), self.k)
        sampled = sampling is not None and not sampling.all_greedy
        if sampled and self.draft_probs is None:
            self.draft_probs = torch.zeros(self.draft_tokens.shape + (self.head.config.vocab_size,), device=self.device)
        probs = self.draft_probs[:n] if sampled else None
        if not width:
            counts.zero_()
            return DraftBatch(tokens, counts, probs)
        self._sampling, self._qs = None, []
        self._take_later()
        if sampled:
            temps = sampling.temperature.tolist()
            # (row, its limit, its generator): a row draws only for the drafts it keeps, so that a seeded
            # request's draws do not depend on the rest of the batch
            self._sampling = (sampling.temperature.to(self.device),
                              [(b, max_drafts[b], sampling.generators[b]) for b in range(n) if temps[b] > 0])
        slots = torch.tensor([r.slot for r in rows], device=self.device)
        drafted = self._draft(rows, self.last[slots], width)  # [n, width]
        limits = torch.tensor(max_drafts, device=self.device).clamp(max=width)
        keep = torch.arange(width, device=self.device)[None, :] < limits[:, None]
        tokens[:, :width] = drafted.masked_fill(~keep, -1)
        counts.copy_(limits)
        if sampled:
            probs.zero_()
            probs[:, :width] = torch.stack(self._qs, dim=1)
        parents = None if self.tree is None else self.tree.parent_tensor(n, self.device)
        # a head per draft in one pass (Medusa), or a stage per draft in turn (MLP speculator)
        return DraftBatch(tokens, counts, probs, parents, forwards=width if self.per_token_drafts else 1)

    def _pick(self, logits: torch.Tensor) -> torch.Tensor:
        """One draft per row [n] from logits [n, V]: the argmax, or for sampling rows a draw whose q is kept."""
        if self._sampling is None:
            return logits.argmax(-1)
        temperature, rows = self._sampling
        position = len(self._qs)
        drawn, _, q = choose(logits, temperature, [(b, g) for b, limit, g in rows if limit > position])
        self._qs.append(q)
        return drawn

    def _draft(self, rows: Sequence[RowState], hidden: torch.Tensor, width: int) -> torch.Tensor:
        """[n, width] drafts from the rows' last hidden states [n, H], each chosen by `_pick` in order."""
        raise NotImplementedError
