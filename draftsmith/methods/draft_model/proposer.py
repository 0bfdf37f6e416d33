"""The draft-model proposer. Per slot it remembers which token ids its KV cache holds (positions 0..len-1:
what it was fed, verified or drafted); each propose keeps the longest prefix the request still has, feeds the
rest (the prompt the first time, then the tokens the last verify added) in one forward for all drafting
rows, and drafts from there one forward per token. With `parallel_drafting` (PARD) that same forward also
reads w - 1 mask tokens after the row's tokens and its last w outputs are the w drafts: one forward a step.
The masks' keys and values land past what the slot holds (`fed` never lists them) and are overwritten by
the next feed."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch

from draftsmith.errors import DraftsmithError
from draftsmith.methods.draft_model.head import MASK_TOKEN_KEYS, TRAINED_DEPTH_KEY, mask_token_id
from draftsmith.methods.draft_sampling import choose, choose_block
from draftsmith.methods.heads import draft_dtype, pack_draft_weights
from draftsmith.methods.proposer_base import DraftBatch, DraftSampling, Proposer, RowState
from draftsmith.models.kv_cache import ForwardBatch
from draftsmith.models.loader import load_target


class DraftModelProposer(Proposer):
    def __init__(self, config, target, max_num_seqs: int, max_model_len: int):
        super().__init__(config, target, max_num_seqs, max_model_len)
        weight = target.model.embed_tokens.weight
        self.device = weight.device
        self.draft = load_target(config.model, dtype=draft_dtype(config.draft_dtype, weight.dtype, self.device),
                                 device=self.device, max_len=max_model_len + config.num_speculative_tokens)
        pack_draft_weights(config.draft_dtype, [self.draft], target)
        vocab, target_vocab = self.draft.config.vocab_size, target.config.vocab_size
        if vocab != target_vocab:
            raise DraftsmithError(f"draft model {config.model} has a vocabulary of {vocab} tokens, the target "
                                  f"{target_vocab}: a draft model must share the target's tokenizer")
        self.tokenizer_dir = str(config.model)
        self.pard_token = None
        if config.parallel_drafting:
            draft_config = json.loads((Path(config.model) / "config.json").read_text())
            trained = draft_config.get(TRAINED_DEPTH_KEY)
            if isinstance(trained, int) and config.num_speculative_tokens > trained:
                raise DraftsmithError(f"num_speculative_tokens {config.num_speculative_tokens}: {config.model} was "
                                      f"adapted to draft {trained} tokens in one forward ({TRAINED_DEPTH_KEY} in its "
                                      f"config.json); ask for {trained} or fewer, or adapt it for more")
            self.pard_token = mask_token_id(draft_config)
            if self.pard_token is None:
                raise DraftsmithError(f"parallel_drafting needs a PARD draft, and {config.model}/config.json names no "
                                      f"mask token ({' / '.join(MASK_TOKEN_KEYS)}): adapt it with `draftsmith train` "
                                      "(recipes/pard-house.yaml) or drop parallel_drafting")
            if not 0 <= self.pard_token < vocab:
                raise DraftsmithError(f"{config.model}: mask token {self.pard_token} is outside its vocabulary of {vocab}")
        # one forward drafts every token: the cost model prices drafting as one draft forward
        self.per_token_drafts = not config.parallel_drafting
        # the masks of a parallel draft sit past the row's tokens: room for them in the draft's cache
        self.cache = self.draft.make_cache(max_num_seqs, max_model_len + config.num_speculative_tokens)
        self.window = self.draft.config.sliding_window
        self.k = config.num_speculative_tokens
        self.owner: list[str | None] = [None] * max_num_seqs
        self.fed: list[list[int]] = [[] for _ in range(max_num_seqs)]  # ids whose KV the slot's cache holds
        self.checked = [0] * max_num_seqs  # a prefix of `fed` known to be the request's own tokens
        self.draft_tokens = torch.full((max_num_seqs, self.k), -1, dtype=torch.long, device=self.device)
        self.draft_counts = torch.zeros(max_num_seqs, dtype=torch.long, device=self.device)
        self.draft_probs: torch.Tensor | None = None  # [max_num_seqs, k, V], on the first sampled draft

    def draft_models(self) -> list[torch.nn.Module]:
        return [self.draft]

    def _kept(self, row: RowState, tokens: list[int]) -> int:
        """How many of the slot's cached positions still hold the request's tokens (the rest are dropped)."""
        slot = row.slot
        if self.owner[slot] != row.request_id:
            self.owner[slot], self.fed[slot], self.checked[slot] = row.request_id, [], 0
        fed, kept = self.fed[slot], self.checked[slot]
        while kept < len(fed) and kept < len(tokens) and fed[kept] == tokens[kept]:
            kept += 1
        kept = min(kept, len(tokens) - 1)  # the newest token is always fed: its logits give the first draft
        del fed[kept:]
        return kept

    def catch_up(self, rows: Sequence[RowState]) -> tuple[int, int]:
        extra = [r.num_tokens - (len(self.fed[r.slot]) if self.owner[r.slot] == r.request_id else 0) - (self.k + 1)
                 for r in rows]
        long = [e for e in extra if e > 0]
        return len(long), max(long, default=0)

    def unfed_rows(self, rows: Sequence[RowState]) -> list[int]:
        return [b for b, r in enumerate(rows) if self.owner[r.slot] != r.request_id]

    def catch_up_model(self) -> tuple[torch.nn.Module, str]:
        return self.draft, str(self.config.model)

    @torch.inference_mode()
    def propose(self, rows: Sequence[RowState], max_drafts: list[int], sampling: DraftSampling | None = None,
                stop_below: float = 0.0) -> DraftBatch:
        n = len(rows)
        tokens_out, counts_out, probs_out = self.cleared_outputs(n, sampling, self.draft.config.vocab_size)
        sampled = probs_out is not None
        active = [b for b in range(n) if max_drafts[b] > 0]
        if not active:
            return DraftBatch(tokens_out, counts_out, probs_out)
        width = min(max(max_drafts[b] for b in active), self.k)
        limits = [min(max_drafts[b], width) for b in active]
        generators = {}
        temperature = None
        if sampled:
            temperature = sampling.temperature.to(self.device)[torch.tensor(active, device=self.device)]
            temps = sampling.temperature.tolist()
            generators = {j: sampling.generators[b] for j, b in enumerate(active) if temps[b] > 0}
        # one forward feeds every row what its cache lacks; its last position yields draft 1
        slots, starts, news = [], [], []
        for b in active:
            row = rows[b]
            tokens = row.all_token_ids()
            kept = self._kept(row, tokens)
            slots.append(row.slot)
            starts.append(kept)
            news.append(tokens[kept:])
            self.fed[row.slot] += tokens[kept:]
            self.checked[row.slot] = len(tokens)
        q_lens = [len(t) for t in news]
        steady = max(q_lens) <= self.k + 1  # a prompt's catch-up is a one-off the policy prices apart
        if self.pard_token is not None:
            self._propose_parallel(active, slots, starts, news, limits, width, generators, temperature,
                                   tokens_out, probs_out)
            counts_out[torch.tensor(active, device=self.device)] = torch.tensor(limits, device=self.device)
            return DraftBatch(tokens_out, counts_out, probs_out, forwards=1, steady=steady)
        ids = torch.zeros(len(active), max(q_lens), dtype=torch.long)
        for j, new in enumerate(news):
            ids[j, : len(new)] = torch.tensor(new)
        batch = ForwardBatch.build(slots, starts, q_lens, self.cache, self.window, self.device, pack=True)
        last = torch.tensor(q_lens, device=self.device)[:, None] - 1
        logits = self.draft(ids.to(self.device), cache=self.cache, batch=batch, logits_index=last).logits[:, 0]
        live = list(range(len(active)))  # rows (indices into `active`) drafting this position
        for step in range(width):
            # a row draws only for the drafts it keeps: a seeded request's draws do not depend on the batch
            draws = [(i, generators[j]) for i, j in enumerate(live) if j in generators]
            drawn, _, q = choose(logits, None if temperature is None else temperature[live], draws)
            rows_t = torch.tensor([active[j] for j in live], device=self.device)
            tokens_out[rows_t, step] = drawn
            if sampled:
                probs_out[rows_t, step] = q
            # only rows that draft another token feed this one (past its limit a row could pass the cache)
            further = [i for i, j in enumerate(live) if limits[j] > step + 1]
            if not further:
                break
            live = [live[i] for i in further]
            fed = drawn[torch.tensor(further, device=self.device)]
            for j, token in zip(live, fed.tolist()):
                self.fed[slots[j]].append(token)
            batch = ForwardBatch.build([slots[j] for j in live], [starts[j] + q_lens[j] + step for j in live],
                                       [1] * len(live), self.cache, self.window, self.device)
            logits = self.draft(fed[:, None], cache=self.cache, batch=batch).logits[:, 0]
        counts_out[torch.tensor(active, device=self.device)] = torch.tensor(limits, device=self.device)
        return DraftBatch(tokens_out, counts_out, probs_out, forwards=width, steady=steady)

    def _propose_parallel(self, active, slots, starts, news, limits, width, generators, temperature,
                          tokens_out, probs_out) -> None:
        """PARD: each row's new tokens, then its limit - 1 masks, in one forward; outputs from the row's last
        real token on are its drafts."""
        q_lens = [len(new) + limit - 1 for new, limit in zip(news, limits)]
        ids = torch.full((len(active), max(q_lens)), self.pard_token, dtype=torch.long)
        for j, new in enumerate(news):
            ids[j, : len(new)] = torch.tensor(new)
        last = torch.tensor([len(new) - 1 for new in news])[:, None] + torch.arange(width)[None]
        last = last.minimum(torch.tensor(q_lens)[:, None] - 1)  # past a row's limit: repeats, never kept
        batch = ForwardBatch.build(slots, starts, q_lens, self.cache, self.window, self.device, pack=True)
        logits = self.draft(ids.to(self.device), cache=self.cache, batch=batch,
                            logits_index=last.to(self.device)).logits  # [rows, width, V]
        choose_block(logits, limits, torch.tensor(active, device=self.device), temperature, generators, tokens_out,
                     probs_out)

    def release(self, request: RowState) -> None:
        if request.slot is not None and self.owner[request.slot] == request.request_id:
            self.owner[request.slot] = None
