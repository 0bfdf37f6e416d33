"""EAGLE and EAGLE-3 proposer: the head drafts k tokens autoregressively from the target's features.

Per request the head keeps its own KV cache slot, in step with the target's. Each target forward hands over
the features of newly verified positions (`observe`); they wait in a per-slot *pending* buffer until the
next `propose`, whose first head forward (the catch-up) runs over them, feature at position p with token
p+1, filling the head's cache and yielding draft 1 from the last one. Drafts 2..k then feed the head its own
output. Draft-step entries past the verified prefix are overwritten next round, like the target's rejected
entries: nothing is copied.

The pending buffer is `[max_num_seqs, W, F]` with W at most MAX_PENDING, not max_model_len wide: a whole
prompt of EAGLE-3 features (3 x hidden each) for every slot would cost hundreds of MB. Rows are *flushed*
inside `observe` (the head runs over every pending position whose next token the row already holds,
keeping at least the last one for the catch-up) in two cases: a prompt chunk, so that a prompt is caught
up in its prefill step by its own rows instead of padding every row's next catch-up to its length; and a
row whose pending would outgrow W after many steps that skipped speculation.

The draft loop runs at a fixed width: every row that caught up takes part in every step, and rows that hit
their limit or fell below the confidence floor (`stop_below`, on the running product of their drafts'
probabilities; the first draft is always kept) keep computing with their outputs masked. Positions and attention masks for all steps are
built at once on the host, so no step waits on the device unless `stop_below` asks to stop early.

With sampled drafting (the config's draft_sample_method "probabilistic") a row that samples draws its
draft from q = softmax(head logits / T) at its own temperature, with its own generator, and q (spread over
the target vocabulary) goes to the rejection sampler, which accepts with probability min(1, p/q). Greedy
rows always take the argmax.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from draftsmith.errors import DraftsmithError
from draftsmith.methods.base import DraftBatch, DraftSampling, Proposer, RowState
from draftsmith.methods.heads import load_head
from draftsmith.models.kv_cache import ForwardBatch

# Pending positions kept per slot, at most: enough that steps which skip speculation flush rarely, few
# enough that a catch-up after them stays one small forward. The buffer also stays within PENDING_BYTES.
MAX_PENDING = 64
PENDING_BYTES = 64 * 2**20
# Positions per head forward when `observe` flushes (a prompt): bounds the [positions, draft_vocab] logits.
FLUSH_TOKENS = 512


def _token_ids(rows: Sequence[RowState], first: list[int], counts: list[int], width: int) -> torch.Tensor:
    """[len(rows), width] long: row i's tokens at positions first[i] + 1 .. first[i] + counts[i], 0-padded."""
    flat: list[int] = []
    for row, begin, n in zip(rows, first, counts):
        begin, offset = begin + 1, len(row.prompt_token_ids)
        # decode rows need only the tail of their output: skip rebuilding the whole sequence
        ids = row.output_token_ids[begin - offset : begin - offset + n] if begin >= offset else \
            row.all_token_ids()[begin : begin + n]
        if len(ids) != n:
            raise DraftsmithError(f"request {row.request_id}: token ids {begin}..{begin + n - 1} are not known yet")
        flat += ids
    counts_t = torch.tensor(counts)
    out = torch.zeros(len(rows), width, dtype=torch.long)
    out[torch.arange(width)[None, :] < counts_t[:, None]] = torch.tensor(flat, dtype=torch.long)
    return out


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
        self.max_num_seqs = max_num_seqs
        # target id of each draft-vocabulary id: where a sampled draft's q lands in the target vocabulary
        self.draft_to_target = self.head.to_target_ids(torch.arange(self.head.config.draft_vocab_size,
                                                                    device=self.device))
        self.draft_tokens = torch.full((max_num_seqs, self.k), -1, dtype=torch.long, device=self.device)
        self.draft_counts = torch.zeros(max_num_seqs, dtype=torch.long, device=self.device)
        self.confidence = torch.zeros(max_num_seqs, self.k, device=self.device)
        self.last_confidence = self.confidence[:0]  # [B, k] running probability products of the last call
        self.draft_probs: torch.Tensor | None = None  # [max_num_seqs, k, V], allocated on first sampled draft
        self.max_model_len = max_model_len
        self.pending_width = 0  # W, set with the buffer once the feature width is known
        self.pending: torch.Tensor | None = None  # [max_num_seqs + 1, W, F] (last row: scratch), on first observe
        # host metadata per slot: the first pending position (-1: slot unused) and how many are pending
        self.pending_start = torch.full((max_num_seqs,), -1, dtype=torch.long)
        self.pending_len = torch.zeros(max_num_seqs, dtype=torch.long)

    def features(self, hidden_states):
        return self.head.features(hidden_states)

    @torch.inference_mode()
    def observe(self, rows: Sequence[RowState], starts: list[int], counts: list[int], features: torch.Tensor) -> None:
        if self.pending is None:
            # at least 2(k+1), whatever the budget: a verify step's k+1 positions, which wait for their next
            # token and so cannot be flushed, must always fit
            fit = PENDING_BYTES // ((self.max_num_seqs + 1) * features.shape[-1] * features.element_size())
            self.pending_width = min(max(min(fit, MAX_PENDING), 2 * (self.k + 1)), self.max_model_len)
            self.pending = features.new_zeros(self.max_num_seqs + 1, self.pending_width, features.shape[-1])
        slots = torch.tensor([r.slot for r in rows], dtype=torch.long)
        start, count = torch.tensor(starts, dtype=torch.long), torch.tensor(counts, dtype=torch.long)
        first, held = self.pending_start[slots], self.pending_len[slots]
        fresh = first < 0
        first = torch.where(fresh, start, first)
        if (~fresh & (start != first + held)).any():
            raise DraftsmithError("observed positions must continue each request's earlier ones")
        skip = torch.zeros_like(count)  # leading new positions the flush consumed
        # a prompt chunk (more than a verify step brings) is flushed at once, by its own rows: left pending,
        # it would pad every row's next catch-up to its length
        over = (held + count > self.pending_width) | (count > self.k + 1)
        if over.any():
            self._flush(rows, over.nonzero()[:, 0], slots, first, held, count, features, skip)
        # One scatter appends row b's features[skip_b:count_b] after its pending ones; columns outside that
        # range go to the scratch row, so nothing depends on the host knowing which rows have what.
        lo, hi = int(skip.min()), int(count.max())
        if hi > lo:
            cols = torch.arange(lo, hi)[None, :]
            real = (cols >= skip[:, None]) & (cols < count[:, None])
            to_slot = torch.where(real, slots[:, None], self.max_num_seqs)
            to_col = torch.where(real, held[:, None] + cols - skip[:, None], 0)
            self.pending[to_slot.to(self.device), to_col.to(self.device)] = features[:, lo:hi]
        self.pending_start[slots] = first
        self.pending_len[slots] = held + count - skip

    def _flush(self, rows, over, slots, first, held, count, features, skip) -> None:
        """Runs the head over the pending + new positions of rows `over` whose next token is known, keeping
        at least the last one pending; updates first, held and skip of those rows in place."""
        over_rows = [rows[i] for i in over.tolist()]
        known = torch.tensor([r.num_tokens for r in over_rows]) - 1 - first[over]
        total = held[over] + count[over]
        done = torch.minimum(total - 1, known)  # >= held: every earlier pending position has its next token
        if (total - done > self.pending_width).any():
            raise DraftsmithError(f"more than {self.pending_width} observed positions wait for their next token")
        # row r's positions in order: its pending ones, then its new ones
        merged = torch.cat([self.pending[slots[over].to(self.device)], features[over.to(self.device)]], dim=1)
        tokens = _token_ids(over_rows, first[over].tolist(), done.tolist(), int(done.max()))
        # in chunks: a prompt's logits over the draft vocabulary would otherwise all exist at once
        chunk = max(1, FLUSH_TOKENS // len(over_rows))
        for lo in range(0, int(done.max()), chunk):
            cols = torch.arange(lo, min(lo + chunk, tokens.shape[1]))[None, :]
            index = torch.where(cols < held[over, None], cols, self.pending_width + cols - held[over, None])
            hidden = merged.gather(1, index.to(self.device)[:, :, None].expand(-1, -1, merged.shape[-1]))
            q_lens = (done - lo).clamp(0, cols.shape[1]).tolist()
            # a row already done sits at its own end: a start past it could run past the cache
            starts = (first[over] + torch.minimum(done, torch.tensor(lo))).tolist()
            self._head_batch(slots[over].tolist(), starts, q_lens, tokens[:, cols[0]], hidden)
        skip[over] = done - held[over]
        first[over] += done
        held[over] = 0

    def release(self, request: RowState) -> None:
        if request.slot is not None:  # a request aborted while waiting never had one
            self.pending_start[request.slot] = -1
            self.pending_len[request.slot] = 0

    def _head_batch(self, slots, starts, q_lens, tokens, hidden):
        batch = ForwardBatch.build(slots, starts, q_lens, self.cache, None, self.device)
        return self.head.step(tokens.to(self.device), hidden, batch.positions, True, self.cache, batch)

    def _choose(self, logits: torch.Tensor, temperature: torch.Tensor | None, draws: list[tuple[int, torch.Generator]]):
        """logits [A, draft_vocab] -> (target token ids [A], probability of each choice [A], q over the draft
        vocab [A, draft_vocab] or None when every row is greedy). `draws` pairs the rows that sample now
        with their generators."""
        logits = logits.float()
        if temperature is None:  # one fused softmax gives the argmax and its probability together
            top, argmax = torch.softmax(logits, dim=-1).max(-1)
            return self.head.to_target_ids(argmax), top, None
        argmax = logits.argmax(-1)
        greedy = temperature == 0
        probs = torch.softmax(logits / torch.where(greedy, 1.0, temperature)[:, None], dim=-1)
        noise = torch.ones_like(probs)
        for row, generator in draws:  # each request draws from its own generator: seeded runs repeat
            noise[row].exponential_(generator=generator)
        drawn = torch.where(greedy, argmax, (probs / noise).argmax(-1))
        return self.head.to_target_ids(drawn), probs.gather(1, drawn[:, None])[:, 0], probs

    def _step_batches(self, slots: torch.Tensor, base: torch.Tensor, steps: int) -> list[ForwardBatch]:
        """One-token batches for draft steps 2..steps+1: step s sits at base + s - 1 in every row's own slot."""
        positions = (base[:, None] + torch.arange(steps)[None, :]).clamp(max=self.cache.max_len - 1)
        kv_len = int(positions.max()) + 1
        mask = (torch.arange(kv_len)[None, None, :] <= positions[:, :, None]).to(self.device)  # [A, steps, kv]
        positions, read = positions.to(self.device), slots.to(self.device)
        listed = slots.tolist()
        contiguous = listed == list(range(listed[0], listed[0] + len(listed)))
        last = base.max().item()
        return [ForwardBatch(positions=positions[:, s : s + 1], read_slots=read, write_slots=read[:, None],
                             mask=mask[:, None, s : s + 1, : min(last + s + 1, kv_len)],
                             kv_len=min(last + s + 1, kv_len), slot_start=listed[0] if contiguous else None)
                for s in range(steps)]

    @torch.inference_mode()
    def propose(self, rows: Sequence[RowState], max_drafts: list[int], sampling: DraftSampling | None = None) -> DraftBatch:
        n_rows = len(rows)
        tokens_out, counts_out = self.draft_tokens[:n_rows], self.draft_counts[:n_rows]
        self.last_confidence = self.confidence[:n_rows]
        tokens_out.fill_(-1)
        counts_out.zero_()
        self.last_confidence.zero_()
        self.steps_run = 0
        sampled = sampling is not None and not sampling.all_greedy
        if sampled and self.draft_probs is None:  # columns outside draft_to_target stay 0 for good
            self.draft_probs = torch.zeros(self.draft_tokens.shape + (self.vocab_size,), device=self.device)
        probs_out = self.draft_probs[:n_rows] if sampled else None
        slots = torch.tensor([r.slot for r in rows], dtype=torch.long)
        limits = torch.tensor(max_drafts, dtype=torch.long)
        active = ((limits > 0) & (self.pending_len[slots] > 0)).nonzero()[:, 0]
        if not len(active):
            return DraftBatch(tokens_out, counts_out, probs_out)
        host_active = active.tolist()
        temperature, draws = None, []
        if sampled:
            temperature = sampling.temperature.to(self.device)[active.to(self.device)]
            temps = sampling.temperature.tolist()
            draws = [(j, sampling.generators[i]) for j, i in enumerate(host_active) if temps[i] > 0]
        slots = slots[active]
        base = self.pending_start[slots] + self.pending_len[slots]  # where draft step 2 sits
        state, logits = self._catch_up([rows[i] for i in host_active], slots)
        act_dev = active.to(self.device)
        q_out = torch.zeros(len(active), self.k, len(self.draft_to_target), device=self.device) if sampled else None
        drafted, confidence = self._draft(state, logits, slots, base, limits[active], temperature, draws, q_out)
        tokens_out[act_dev] = drafted
        counts_out[act_dev] = (drafted >= 0).sum(-1)
        self.last_confidence[act_dev] = confidence
        if sampled:
            steps = torch.arange(self.k, device=self.device)
            probs_out[act_dev[:, None, None], steps[None, :, None], self.draft_to_target[None, None, :]] = q_out
        return DraftBatch(tokens_out, counts_out, probs_out)

    def _catch_up(self, rows: list[RowState], slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The head over the rows' pending positions -> (head output [A, H], logits [A, draft_vocab]) at the
        last one of each row, which yield draft 1."""
        first, held = self.pending_start[slots], self.pending_len[slots]
        width = int(held.max())
        tokens = _token_ids(rows, first.tolist(), held.tolist(), width)
        hidden = self.pending[slots.to(self.device), :width]
        out, logits = self._head_batch(slots.tolist(), first.tolist(), held.tolist(), tokens, hidden)
        self.pending_start[slots] = first + held
        self.pending_len[slots] = 0
        index, last = torch.arange(len(rows), device=self.device), (held - 1).to(self.device)
        return out[index, last], logits[index, last]

    def _draft(self, state, logits, slots, base, limits, temperature, draws, q_out):
        """Drafts 1..max(limits) for A rows at a fixed width -> (target ids [A, k], -1 past each row's count;
        running probability products [A, k], 0 past it). q_out [A, k, draft_vocab] receives sampled q."""
        rows, host_limits = len(limits), limits.tolist()
        steps = max(host_limits)
        batches = self._step_batches(slots, base, steps - 1) if steps > 1 else []
        limits = limits.to(self.device)
        drafted = torch.full((rows, self.k), -1, dtype=torch.long, device=self.device)
        probs = torch.zeros(rows, self.k, device=self.device)
        product = torch.ones(rows, device=self.device)
        still = [True] * rows  # host copy of "still extending", refreshed only when stop_below can end rows early
        ids = None
        for s in range(steps):
            if s:  # the head's own output and draft stand in for the target's feature and token
                out, logits = self.head.step(ids[:, None], state[:, None], batches[s - 1].positions, False,
                                             self.cache, batches[s - 1])
                state, logits = out[:, 0], logits[:, 0]
            # a row that stopped draws no more: its generator advances by its own drafts only
            ids, probs[:, s], q = self._choose(logits, temperature,
                                               [(j, g) for j, g in draws if still[j] and host_limits[j] > s])
            drafted[:, s] = ids
            if q is not None:
                q_out[:, s] = q
            self.steps_run = s + 1
            if self.stop_below > 0 and s + 1 < steps:
                product = product * probs[:, s]
                still = ((product >= self.stop_below) & (limits > s)).tolist()  # the one host sync per step
                if not any(still):
                    break
        # Masks applied once, after the loop: the products only fall, so each row keeps a prefix. Draft 1 is
        # kept whatever its confidence: the catch-up that made it is paid, and verifying it costs little.
        confidence = probs.cumprod(1)
        column = torch.arange(self.k, device=self.device)[None, :]
        keep = (column < limits[:, None]) & ((confidence >= self.stop_below) | (column == 0))
        return drafted.masked_fill_(~keep, -1), confidence.masked_fill_(~keep, 0.0)
