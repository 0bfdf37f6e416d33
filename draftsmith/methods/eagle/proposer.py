"""EAGLE and EAGLE-3 proposer: the head drafts k tokens autoregressively from the target's features.

Per request the head keeps its own KV cache slot, in step with the target's: each target forward hands over
the features of newly verified positions (`observe`); at the next `propose` the head first runs over those
pending positions (feature at i with token i+1, both known), which fills its cache and yields draft 1 from
the last one; drafts 2..k then feed the head its own output. Draft-step entries past the verified prefix
are overwritten next round, like the target's rejected entries: nothing is copied.

Drafts are written into persistent `[max_num_seqs, k]` buffers. With sampled drafting (the config's
draft_sample_method "probabilistic") a row that samples draws its draft from q = softmax(head logits / T)
at its own temperature, with its own generator, and q (spread over the target vocabulary) goes to the
rejection sampler, which accepts with probability min(1, p/q). Greedy rows always take the argmax.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from draftsmith.errors import DraftsmithError
from draftsmith.methods.base import DraftBatch, DraftSampling, Proposer, RowState
from draftsmith.methods.heads import load_head
from draftsmith.models.kv_cache import ForwardBatch


class EagleFamilyProposer(Proposer):
    def __init__(self, config, target, max_num_seqs: int, max_model_len: int):
        super().__init__(config, target, max_num_seqs, max_model_len)
        weight = target.model.embed_tokens.weight
        self.head = load_head(config.model, dtype=weight.dtype, device=weight.device)
        if self.head.head_type != config.method:
            raise DraftsmithError(f"{config.model} holds an {self.head.head_type!r} head but the speculative config "
                                  f"says method {config.method!r}")
        self.head.attach_target(target)
        self.head.init_rope(max_model_len)
        self.hidden_layer_ids = self.head.hidden_layer_ids
        self.cache = self.head.make_cache(max_num_seqs, max_model_len)
        self.device = weight.device
        self.k = config.num_speculative_tokens
        self.vocab_size = target.config.vocab_size
        # target id of each draft-vocabulary id: where a sampled draft's q lands in the target vocabulary
        self.draft_to_target = self.head.to_target_ids(torch.arange(self.head.config.draft_vocab_size,
                                                                    device=self.device))
        self.draft_tokens = torch.full((max_num_seqs, self.k), -1, dtype=torch.long, device=self.device)
        self.draft_counts = torch.zeros(max_num_seqs, dtype=torch.long, device=self.device)
        self.draft_probs: torch.Tensor | None = None  # [max_num_seqs, k, V], allocated on first sampled draft
        self.pending: dict[str, tuple[int, list[torch.Tensor]]] = {}  # request id -> (first position, features)

    def features(self, hidden_states):
        return self.head.features(hidden_states)

    def observe(self, rows: Sequence[RowState], starts: list[int], counts: list[int], features: torch.Tensor) -> None:
        for i, (request, start, count) in enumerate(zip(rows, starts, counts)):
            first, chunks = self.pending.get(request.request_id, (start, []))
            chunks.append(features[i, :count])
            self.pending[request.request_id] = (first, chunks)

    def release(self, request: RowState) -> None:
        self.pending.pop(request.request_id, None)

    def _run(self, slots, tokens, hidden, starts, q_lens, from_target):
        batch = ForwardBatch.build(slots, starts, q_lens, self.cache, None, self.device)
        return self.head.step(tokens.to(self.device), hidden, batch.positions, from_target, self.cache, batch)

    def _choose(self, logits: torch.Tensor, rows: list[int], sampling: DraftSampling | None):
        """logits [n, draft_vocab] of rows `rows` -> (target token ids [n], q over the target vocab [n, V] or
        None when every row is greedy)."""
        argmax = logits.argmax(-1)
        if sampling is None or sampling.all_greedy:
            return self.head.to_target_ids(argmax), None
        temperature = sampling.temperature.to(logits.device)[rows]
        greedy = temperature == 0
        probs = torch.softmax(logits.float() / torch.where(greedy, 1.0, temperature)[:, None], dim=-1)
        noise = torch.ones_like(probs)
        for j, row in enumerate(rows):  # each request draws from its own generator: seeded runs repeat
            if not greedy[j]:
                noise[j].exponential_(generator=sampling.generators[row])
        drawn = torch.where(greedy, argmax, (probs / noise).argmax(-1))
        q = torch.zeros(len(rows), self.vocab_size, dtype=torch.float32, device=logits.device)
        q[:, self.draft_to_target] = probs
        return self.head.to_target_ids(drawn), q

    @torch.inference_mode()
    def propose(self, rows: Sequence[RowState], max_drafts: list[int], sampling: DraftSampling | None = None) -> DraftBatch:
        n_rows = len(rows)
        tokens_out, counts_out = self.draft_tokens[:n_rows], self.draft_counts[:n_rows]
        tokens_out.fill_(-1)
        counts_out.zero_()
        sampled = sampling is not None and not sampling.all_greedy
        if sampled and self.draft_probs is None:
            self.draft_probs = torch.zeros(self.draft_tokens.shape + (self.vocab_size,), device=self.device)
        probs_out = self.draft_probs[:n_rows] if sampled else None
        active = [i for i, limit in enumerate(max_drafts) if limit > 0 and rows[i].request_id in self.pending]
        if not active:
            return DraftBatch(tokens_out, counts_out, probs_out)
        # 1) catch up on verified positions; the last one predicts draft 1.
        starts, feats = [], []
        for i in active:
            first, chunks = self.pending.pop(rows[i].request_id)
            starts.append(first)
            feats.append(torch.cat(chunks))
        q_lens = [len(f) for f in feats]
        width = max(q_lens)
        hidden = torch.zeros(len(active), width, feats[0].shape[-1], dtype=feats[0].dtype, device=self.device)
        tokens = torch.zeros(len(active), width, dtype=torch.long)
        for j, (i, start, f) in enumerate(zip(active, starts, feats)):
            hidden[j, : len(f)] = f
            tokens[j, : len(f)] = torch.tensor(rows[i].all_token_ids()[start + 1 : start + 1 + len(f)])
        slots = [rows[i].slot for i in active]
        out, logits = self._run(slots, tokens, hidden, starts, q_lens, from_target=True)
        index = torch.arange(len(active), device=self.device)
        last = torch.tensor(q_lens, device=self.device) - 1
        state = out[index, last]
        next_ids, q = self._choose(logits[index, last], active, sampling)
        positions = [s + n for s, n in zip(starts, q_lens)]  # where draft step 2 sits
        # 2) drafts 2..k feed the head its own output; rows drop out as they reach their limit.
        step_rows = list(range(len(active)))  # indices into `active`
        step = 0
        while True:
            at = torch.tensor([active[j] for j in step_rows], device=self.device)
            tokens_out[at, step] = next_ids
            if q is not None:
                probs_out[at, step] = q
            counts_out[at] += 1
            step += 1
            keep_local = [n for n, j in enumerate(step_rows) if max_drafts[active[j]] > step]
            if not keep_local:
                break
            keep = torch.tensor(keep_local, device=self.device)
            step_rows = [step_rows[n] for n in keep_local]
            out, logits = self._run([slots[j] for j in step_rows], next_ids[keep][:, None].cpu(), state[keep][:, None],
                                    [positions[j] for j in step_rows], [1] * len(step_rows), from_target=False)
            state = out[:, 0]
            next_ids, q = self._choose(logits[:, 0], [active[j] for j in step_rows], sampling)
            for j in step_rows:
                positions[j] += 1
        return DraftBatch(tokens_out, counts_out, probs_out)
