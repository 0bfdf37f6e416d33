"""EAGLE and EAGLE-3 proposer: the head drafts k tokens autoregressively from the target's features.

Per request the head keeps its own KV cache slot, in step with the target's. Each target forward hands over
the features of newly verified positions (`observe`); they wait in a per-slot *pending* buffer until the
next `propose`, whose first head forward (the catch-up) runs over them, feature at position p with token
p+1, filling the head's cache and yielding draft 1 from the last one. Drafts 2..k then feed the head its own
output. Draft-step entries past the verified prefix are overwritten next round, like the target's rejected
entries: nothing is copied.

The pending buffer (`pending.PendingFeatures`) is a ring of each slot's newest W positions; the head's
context starts at the first it kept.

The draft loop runs at a fixed width: every row that caught up takes part in every step, and rows that hit
their limit keep computing with their outputs masked. It stops early once the rows' mean chance of getting
further (running products of their drafts' probabilities) falls below the confidence floor `stop_below`;
rows are not cut one by one, since a draft inside the batch's verify width costs nothing more to verify.
Positions and attention masks for all steps are built at once on the host, so no step waits on the device
unless `stop_below` asks to stop early.

With sampled drafting (the config's draft_sample_method "probabilistic") a row that samples draws its
draft from q = softmax(head logits / T) at its own temperature, with its own generator, and q (spread over
the target vocabulary) goes to the rejection sampler, which accepts with probability min(1, p/q). Greedy
rows always take the argmax.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from draftsmith.errors import DraftsmithError
from draftsmith.methods.draft_sampling import choose, pick_greedy
from draftsmith.methods.draft_trees import TreeShape, configured_tree
from draftsmith.methods.eagle.pending import PendingFeatures
from draftsmith.methods.eagle.tree_drafting import draft_static_tree, draft_tree
from draftsmith.methods.heads import draft_dtype, load_attached_head, pack_draft_weights
from draftsmith.methods.proposer_base import DraftBatch, DraftSampling, DraftTimer, Proposer, RowState
from draftsmith.models.draft_step_cpu import CATCH_UP_QUERIES
from draftsmith.models.kv_cache import ForwardBatch


def _token_ids(rows: Sequence[RowState], first: list[int], counts: list[int], width: int) -> torch.Tensor:
    """[len(rows), width] long: row i's tokens at positions first[i] + 1 .. first[i] + counts[i], 0-padded."""
    padded: list[list[int]] = []
    for row, begin, n in zip(rows, first, counts):
        begin, offset = begin + 1, len(row.prompt_token_ids)
        # decode rows need only the tail of their output: skip rebuilding the whole sequence
        ids = row.output_token_ids[begin - offset : begin - offset + n] if begin >= offset else \
            row.all_token_ids()[begin : begin + n]
        if len(ids) != n:
            raise DraftsmithError(f"request {row.request_id}: token ids {begin}..{begin + n - 1} are not known yet")
        padded.append(list(ids) + [0] * (width - n))
    return torch.tensor(padded, dtype=torch.long)


class EagleFamilyProposer(Proposer):
    def __init__(self, config, target, max_num_seqs: int, max_model_len: int):
        super().__init__(config, target, max_num_seqs, max_model_len)
        weight = target.model.embed_tokens.weight
        self.dtype = draft_dtype(config.draft_dtype, weight.dtype, weight.device)
        self.head = load_attached_head(config, target, self.dtype)
        pack_draft_weights(config.draft_dtype, [self.head], target)
        self.k = config.num_speculative_tokens
        # a static tree, or EAGLE-2's dynamic one (tree_drafting), when the config asks for one
        self.tree = configured_tree(config, self.k)
        # k positions of room past max_model_len: draft steps run all rows at one width, so a row whose
        # context is nearly full goes on drafting (its drafts discarded) past where its own limit stopped it;
        # a dynamic tree's nodes take more
        room = max(self.k, self.tree.cache_room) if isinstance(self.tree, TreeShape) else self.k
        self.head.init_rope(max_model_len + room)
        self.feature_layers = self.head.feature_layers
        self.window = self.head.sliding_window  # the head's own attention window, if it has one
        self.cache = self.head.make_cache(max_num_seqs, max_model_len + room)
        if self.head.cache_layers > 1:  # the policy's default guess is a one-layer head's; here its layers and
            # its LM head (about one more) against the target's layers and LM head
            self.draft_cost_guess = (self.head.cache_layers + 1) / (target.config.num_hidden_layers + 1)
        self.device = weight.device
        self.vocab_size = target.config.vocab_size
        self.max_num_seqs = max_num_seqs
        # target id of each draft-vocabulary id: where a sampled draft's q lands in the target vocabulary
        self.draft_to_target = self.head.to_target_ids(torch.arange(self.head.draft_vocab_size,
                                                                    device=self.device))
        self.draft_tokens = torch.full((max_num_seqs, self.k), -1, dtype=torch.long, device=self.device)
        self.draft_counts = torch.zeros(max_num_seqs, dtype=torch.long, device=self.device)
        self.draft_parents = torch.full((max_num_seqs, self.k), -1, dtype=torch.long, device=self.device)
        self.confidence = torch.zeros(max_num_seqs, self.k, device=self.device)
        self.last_confidence = self.confidence[:0]  # [B, k] running probability products of the last call
        self.draft_probs: torch.Tensor | None = None  # [max_num_seqs, k, V], allocated on first sampled draft
        self.max_model_len = max_model_len
        self.pending = PendingFeatures(max_num_seqs, self.k, max_model_len, self.device,
                                       self.features,
                                       self.feature_layers)
        self.observe_window = self.pending.window
        # P-EAGLE: drafts 2..k from k - 1 slots appended to the catch-up forward (`parallel_inputs`)
        self.parallel_slots = self._parallel_slots(config)
        if self.parallel_slots is not None:
            self.per_token_drafts = False  # one forward drafts any width

    def draft_models(self) -> list[torch.nn.Module]:
        return [self.head]

    def _parallel_slots(self, config) -> int | None:
        """k - 1 under `parallel_drafting`, for a head trained for it; None otherwise."""
        if not getattr(config, "parallel_drafting", False):
            return None
        if not self.head.config.parallel_drafting:
            raise DraftsmithError(f"parallel_drafting: {config.model} is a sequential EAGLE-3 head (no mask_hidden, "
                                  "no ptd_token_id): train one with model.parallel_drafting, or drop the key")
        return self.k - 1

    def features(self, hidden_states):
        return self.head.features(hidden_states).to(self.dtype)  # kept pending in the head's dtype

    def observe_later(self, rows: Sequence[RowState], starts: list[int], hidden_states) -> bool:
        return self.pending.observe_later(rows, starts, hidden_states)

    @torch.inference_mode()
    def observe(self, rows: Sequence[RowState], starts: list[int], counts: list[int], features: torch.Tensor) -> None:
        self.pending.replay()
        self.pending.observe([r.slot for r in rows], starts, counts, features)

    def catch_up(self, rows: Sequence[RowState]) -> tuple[int, int]:
        extra = [n - (self.k + 1) for n in self.pending.owed([r.slot for r in rows])]
        extra = [n for n in extra if n > 0]
        return len(extra), max(extra, default=0)

    def release(self, request: RowState) -> None:
        if request.slot is not None:  # a request aborted while waiting never had one
            self.pending.release(request.slot)

    def _head_batch(self, slots: list[int], starts, q_lens, tokens, hidden, logits_at):
        batch = ForwardBatch.build(slots, starts, q_lens, self.cache, self.window, self.device,
                                   key_starts=[self.pending.context_start[s] for s in slots])
        return self.head.step(tokens.to(self.device), hidden, batch.positions, True, self.cache, batch,
                              logits_at=logits_at)

    def _choose(self, logits: torch.Tensor, temperature: torch.Tensor | None, draws: list[tuple[int, torch.Generator]]):
        """`draft_sampling.choose` over the draft vocab, its choices as target token ids."""
        if temperature is None:  # all greedy: one fused pick, the draft-to-target map applied in it
            return (*pick_greedy(logits, self.head.draft_offsets()), None)
        drawn, p, probs = choose(logits, temperature, draws)
        return self.head.to_target_ids(drawn), p, probs

    def use_static_steps(self, make_runner):
        if self.parallel_slots is not None:  # no one-token steps after the first forward
            return None
        self.draft_steps = make_runner(self.head, self.cache)
        return self.draft_steps

    def draft_timer(self, context: int) -> DraftTimer | None:
        """A runner's one-token draft step (`use_static_steps`, where the runner says its state's width: the
        fused CPU op), timed by rows at load into the table that prices a draft forward, on slots 0..rows-1 at
        position `context` over whatever their cache holds. Priced from the first guess instead (a third of a
        target decode a step), the demo EAGLE-3 head's fused step at 8 rows was priced about 1.2 ms where it
        took about 0.3, so a batch of 8 held plain decoding where k = 3 ran 1.18x faster, and never drafted
        to learn otherwise. None (eager steps, trees, P-EAGLE): drafting is priced from `draft_cost_guess`
        until timed live."""
        width = getattr(self.draft_steps, "state_width", None)
        if width is None or self.tree is not None or self.parallel_slots is not None:
            return None
        position = min(context, self.cache.max_len - 2)
        opened = [0]  # the rows the runner's loop was opened for: a loop's start is no part of a step's cost

        @torch.inference_mode()
        def step(rows: int) -> None:
            if opened[0] != rows:
                self.draft_steps.begin(list(range(rows)), [position] * rows, [0] * rows)
                opened[0] = rows
            self.draft_steps.step(torch.zeros(rows, dtype=torch.long, device=self.device),
                                  torch.zeros(rows, width, device=self.device))

        return DraftTimer(step, lambda: None, self.device)

    def _key_starts(self, slots: list[int], base: list[int]) -> list[int]:
        """The first key each row's draft steps read. A head with a window of W was trained (speculators'
        mask) with draft step s seeing the verified prefix's newest W positions plus its own s - 1 drafts: so
        every draft step reads from W before its row's first draft on, rather than the W newest positions of
        its own."""
        context_start = self.pending.context_start
        if self.window is None:
            return [context_start[s] for s in slots]
        return [max(context_start[s], b - self.window) for s, b in zip(slots, base)]

    def _step_batches(self, slots: list[int], base: list[int], steps: int) -> list[ForwardBatch]:
        """One-token batches for draft steps 2..steps+1: step s sits at base + s - 1 in every row's own slot.
        Built as one batch of `steps` queries per row, then sliced by step: one host build for all steps."""
        whole = ForwardBatch.build(slots, base, [steps] * len(slots), self.cache, None, self.device,
                                   key_starts=self._key_starts(slots, base))
        last, batches = max(base), []
        for s in range(steps):
            step = {"positions": whole.positions[:, s : s + 1], "write_slots": whole.write_slots[:, s : s + 1],
                    "mask": whole.mask[:, :, s : s + 1]}
            # keys up to this step's last position; rows reading their own windows read as many at every step
            if whole.key_positions is None:
                kv_len = min(last + s + 1, whole.kv_len)
                step.update(mask=step["mask"][..., : kv_len - whole.kv_start], kv_len=kv_len)
            batches.append(replace(whole, **step))
        return batches

    @torch.inference_mode()
    def propose(self, rows: Sequence[RowState], max_drafts: list[int], sampling: DraftSampling | None = None,
                stop_below: float = 0.0) -> DraftBatch:
        self.pending.replay()
        n_rows = len(rows)
        tokens_out, counts_out = self.draft_tokens[:n_rows], self.draft_counts[:n_rows]
        self.last_confidence = self.confidence[:n_rows]
        sampled = sampling is not None and not sampling.all_greedy
        if sampled and self.draft_probs is None:  # columns outside draft_to_target stay 0 for good
            self.draft_probs = torch.zeros(self.draft_tokens.shape + (self.vocab_size,), device=self.device)
        probs_out = self.draft_probs[:n_rows] if sampled else None
        host_active = [i for i, (r, n) in enumerate(zip(rows, max_drafts)) if n > 0 and self.pending.length[r.slot] > 0]
        every = len(host_active) == n_rows  # then the drafts overwrite the outputs whole
        if not every:
            tokens_out.fill_(-1)
            counts_out.zero_()
            self.last_confidence.zero_()
        if not host_active:
            return DraftBatch(tokens_out, counts_out, probs_out)
        active = torch.tensor(host_active)
        temperature, draws = None, []
        if sampled:
            temperature = sampling.temperature.to(self.device)[active.to(self.device)]
            temps = sampling.temperature.tolist()
            draws = [(j, sampling.generators[i]) for j, i in enumerate(host_active) if temps[i] > 0]
        slots = [rows[i].slot for i in host_active]
        base = [self.pending.start[s] + self.pending.length[s] for s in slots]  # where draft step 2 sits
        state, logits, steady = self._catch_up([rows[i] for i in host_active], slots)
        act_dev = active.to(self.device)
        if self.tree is not None:
            tree = self._draft_tree(state, logits, slots, base, host_active, max_drafts, n_rows, stop_below)
            return replace(tree, steady=steady)
        q_out = torch.zeros(len(active), self.k, len(self.draft_to_target), device=self.device) if sampled else None
        limits = [max_drafts[i] for i in host_active]
        if self.parallel_slots is not None:
            drafted, confidence = self._draft_parallel(logits, limits, temperature, draws, q_out)
            forwards = 1  # the catch-up's (a mixed catch-up's second forward is not steady: priced apart)
        else:
            drafted, confidence, forwards = self._draft(state, logits, slots, base, limits, temperature, draws,
                                                        q_out, n_rows, stop_below)
        if every:
            tokens_out.copy_(drafted)
            torch.sum(drafted >= 0, -1, out=counts_out)
            self.last_confidence.copy_(confidence)
        else:
            tokens_out[act_dev] = drafted
            counts_out[act_dev] = (drafted >= 0).sum(-1)
            self.last_confidence[act_dev] = confidence
        if sampled:
            steps = torch.arange(self.k, device=self.device)
            probs_out[act_dev[:, None, None], steps[None, :, None], self.draft_to_target[None, None, :]] = q_out
        return DraftBatch(tokens_out, counts_out, probs_out, forwards=forwards, steady=steady)

    def _draft_tree(self, state, logits, slots, base, host_active: list[int], max_drafts: list[int],
                    n_rows: int, stop_below: float) -> DraftBatch:
        """The active rows' trees (`tree_drafting`), each cut to its row's limit: the first nodes, a tree."""
        starts = self._key_starts(slots, base)
        if isinstance(self.tree, TreeShape):
            forwards = self.tree.depth
            tokens, parents, scores = draft_tree(self.head, self.cache, self.tree, state, logits, slots, base, starts,
                                                 stop_below)
        else:  # static: verified whole, in its own order
            forwards = self.tree.max_depth
            tokens, parents, scores = draft_static_tree(self.head, self.cache, self.tree, state, logits, slots,
                                                        base, starts)
        limits = torch.tensor([max_drafts[i] for i in host_active], device=self.device)
        limits = torch.minimum(limits, (tokens >= 0).sum(-1))  # fewer nodes where drafting stopped early
        keep = torch.arange(self.k, device=self.device)[None, :] < limits[:, None]
        act_dev = torch.tensor(host_active, device=self.device)
        self.draft_tokens[act_dev] = tokens.masked_fill(~keep, -1)
        self.draft_counts[act_dev] = limits
        parents_out = self.draft_parents[:n_rows]
        parents_out.fill_(-1)
        parents_out[act_dev] = parents
        self.last_confidence[act_dev] = scores.exp().masked_fill(~keep, 0.0)
        # a dynamic tree's nodes come likeliest first: the engine may verify the first w (size_trees)
        confidence = self.last_confidence if isinstance(self.tree, TreeShape) else None
        return DraftBatch(self.draft_tokens[:n_rows], self.draft_counts[:n_rows], None, parents_out, confidence,
                          forwards=forwards)

    def _catch_up(self, rows: list[RowState], slots: list[int]) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """The head over the rows' pending positions -> (head output [A, H], logits [A, draft_vocab]) at the
        last one of each row, which yield draft 1, and whether the catch-up was steady (the policy times steady
        proposes only: a long catch-up is a one-off, priced apart). Rows with more pending than one verify step brings (a
        prompt, or a pause) run in a forward of their own: padded into one forward, a single new request's 64
        positions made 32 rows' catch-up cost 100 ms instead of 10."""
        long = [self.pending.length[s] > self.k + 1 for s in slots]
        steady = not any(long)
        if steady or all(long):
            return *self._catch_up_rows(rows, slots), steady
        state = logits = None
        for group in ([i for i, x in enumerate(long) if not x], [i for i, x in enumerate(long) if x]):
            out = self._catch_up_rows([rows[i] for i in group], [slots[i] for i in group])
            if state is None:
                state = out[0].new_empty((len(slots),) + out[0].shape[1:])
                logits = out[1].new_empty((len(slots),) + out[1].shape[1:])
            index = torch.tensor(group, device=self.device)
            state[index], logits[index] = out
        return state, logits, steady

    def _catch_up_rows(self, rows: list[RowState], slots: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (head output [A, H] and logits [A, Vd] at each row's last pending position; under P-EAGLE the
        logits [A, k, Vd] of that position and of the k - 1 draft slots after it, from the same forward)."""
        first = [self.pending.start[s] for s in slots]
        held = [self.pending.length[s] for s in slots]
        width = max(held)
        tokens = _token_ids(rows, first, held, width)
        hidden = self.pending.read(slots, first, width)
        fused = getattr(self.draft_steps, "catch_up", None)  # models.draft_step_cpu: the forward as one op
        if fused is not None and width <= CATCH_UP_QUERIES and not self.parallel_slots:
            state, logits = fused(tokens.to(self.device), hidden, first, held, slots,
                                  [self.pending.context_start[s] for s in slots], self.window)
            self.pending.consumed(slots)
            return state, logits
        last = torch.tensor([n - 1 for n in held], device=self.device)
        q_lens, read_at = held, last
        if self.parallel_slots:
            tokens, hidden, q_lens, read_at = self._with_parallel_slots(tokens.to(self.device), hidden, held)
        out, logits = self._head_batch(slots, first, q_lens, tokens, hidden, read_at)
        self.pending.consumed(slots)
        # each row's output at its last pending position (with equal counts: the last column, a view)
        state = out[:, width - 1] if min(held) == width else out[torch.arange(len(rows), device=self.device), last]
        return state, (logits if self.parallel_slots is not None else logits[:, 0])

    def _with_parallel_slots(self, tokens: torch.Tensor, hidden: torch.Tensor, held: list[int]):
        """Appends P-EAGLE's k - 1 draft slots after each row's pending positions -> (tokens, features, query
        lengths, the k positions each row's drafts are read from)."""
        extra, rows = self.parallel_slots, len(held)
        slot_tokens, slot_hidden = self.head.parallel_inputs(rows, extra, self.device)
        tokens = torch.cat([tokens, slot_tokens], 1)
        hidden = torch.cat([hidden, slot_hidden.to(hidden.dtype)], 1)
        if min(held) < max(held):  # rows holding fewer positions than the widest get their slots moved up
            held_t = torch.tensor(held, device=self.device)
            cols = held_t[:, None] + torch.arange(extra, device=self.device)  # each row's slots, after its own
            at_end = torch.arange(max(held), max(held) + extra, device=self.device).expand(rows, -1)
            index = torch.arange(rows, device=self.device)[:, None]
            tokens[index, cols], hidden[index, cols] = tokens[index, at_end], hidden[index, at_end]
        read_at = torch.tensor([[n - 1 + j for j in range(extra + 1)] for n in held], device=self.device)
        return tokens, hidden, [n + extra for n in held], read_at

    def _draft_parallel(self, logits: torch.Tensor, host_limits: list[int], temperature, draws, q_out):
        """P-EAGLE's drafts from one forward's logits [A, k, Vd]: position s gives draft s + 1, chosen on its
        own (no draft feeds another) -> (target ids [A, k], -1 past each row's limit; running products of
        their probabilities [A, k])."""
        rows, steps = len(host_limits), max(host_limits)
        if temperature is None and min(host_limits) == self.k:  # all greedy, every row drafting all k
            ids, chance, _ = self._choose(logits.reshape(rows * steps, -1), None, [])
            return ids.view(rows, steps), chance.view(rows, steps).cumprod(1)
        drafted = torch.full((rows, self.k), -1, dtype=torch.long, device=self.device)
        probs = torch.zeros(rows, self.k, device=self.device)
        if temperature is None:  # all greedy: one pick over every position
            ids, chance, _ = self._choose(logits[:, :steps].reshape(rows * steps, -1), None, [])
            drafted[:, :steps], probs[:, :steps] = ids.view(rows, steps), chance.view(rows, steps)
        else:
            for s in range(steps):
                # a row past its limit draws no more: its generator advances by its own drafts only
                draws_now = [(j, g) for j, g in draws if host_limits[j] > s]
                drafted[:, s], probs[:, s], q_out[:, s] = self._choose(logits[:, s], temperature, draws_now)
        keep = torch.arange(self.k, device=self.device)[None, :] < torch.tensor(host_limits, device=self.device)[:, None]
        return drafted.masked_fill_(~keep, -1), probs.cumprod(1).masked_fill_(~keep, 0.0)

    def _draft(self, state, logits, slots, base, host_limits: list[int], temperature, draws, q_out, batch_rows: int,
               stop_below: float):
        """Drafts 1..max(limits) for A rows at a fixed width -> (target ids [A, k], -1 past each row's count;
        running probability products [A, k], 0 past it; the draft forwards run). q_out [A, k, draft_vocab]
        receives sampled q."""
        rows, steps = len(host_limits), max(host_limits)
        batches = []
        if steps > 1 and self.draft_steps is not None:  # static steps (serve.engine.step_graphs): no batches to build
            self.draft_steps.begin(slots, base, self._key_starts(slots, base))
        elif steps > 1:
            batches = self._step_batches(slots, base, steps - 1)
        even = min(host_limits) == steps  # every row drafts every step: nothing to mask
        limits = None if even else torch.tensor(host_limits, device=self.device)
        drafted = torch.full((rows, self.k), -1, dtype=torch.long, device=self.device)
        probs = torch.zeros(rows, self.k, device=self.device)
        product = torch.ones(rows, device=self.device)
        ids, forwards = None, 0
        # greedy steps 2.. of a runner that loops them itself (models.draft_step_cpu): one call for them all
        loops = temperature is None and getattr(self.draft_steps, "greedy_steps", None) is not None
        for s in range(steps):
            if s and loops:
                forwards = self.draft_steps.greedy_steps(ids, state, s, steps, self.head.draft_offsets(), drafted,
                                                         probs, product, limits, stop_below, batch_rows)
                break
            if s and self.draft_steps is not None:
                state, logits = self.draft_steps.step(ids, state)
            elif s:  # the head's own output and draft stand in for the target's feature and token
                out, logits = self.head.step(ids[:, None], state[:, None], batches[s - 1].positions, False,
                                             self.cache, batches[s - 1])
                state, logits = out[:, 0], logits[:, 0]
            # a row past its limit draws no more: its generator advances by its own drafts only
            ids, probs[:, s], q = self._choose(logits, temperature, [(j, g) for j, g in draws if host_limits[j] > s])
            drafted[:, s] = ids
            if q is not None:
                q_out[:, s] = q
            forwards = s + 1
            if stop_below > 0 and s + 1 < steps:
                # One more step costs every row a draft forward (the loop is fixed-width) and widens the
                # verify; it gains each row's chance to get that far: go on while the batch's mean chance
                # (0 for rows at their limit or not drafting) clears the floor. The one host sync per step.
                product = product * probs[:, s]
                going = product if even else torch.where(limits > s + 1, product, 0.0)
                if float(going.sum()) < stop_below * batch_rows:
                    break
        # No row is cut short on its own: its drafts up to the steps run cost nothing more to verify.
        confidence = probs.cumprod(1)  # 0 past the steps run
        if even:  # drafts are -1 past the steps run, and every row ran them all
            return drafted, confidence, forwards
        keep = (torch.arange(self.k, device=self.device)[None, :] < limits[:, None]) & (drafted >= 0)
        return drafted.masked_fill_(~keep, -1), confidence.masked_fill_(~keep, 0.0), forwards
