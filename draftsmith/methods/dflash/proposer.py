"""The DFlash proposer. Every target forward's features for newly verified positions are projected at once
into each draft layer's context keys and values, kept per slot at their positions in the head's own cache
(so a step never re-reads old features). A step writes the block [last token, masks] after the context, runs
the draft layers once over it (each block token sees the context and the whole block) and reads the drafts
from the block positions of its layout (`DFlashConfig.draft_slots`). The block's own keys and values land where the next verified positions' context
will overwrite them. With a tree config the same forward's per-depth distributions give a draft tree
(`methods.draft_trees`), whose verified path comes back as a chain's would."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import torch
from torch import nn

from draftsmith.errors import DraftsmithError
from draftsmith.methods.draft_sampling import choose_block
from draftsmith.methods.draft_trees import TreeShape, configured_tree, marginal_tree, static_marginal_tree
from draftsmith.methods.heads import draft_dtype, load_attached_head, pack_draft_weights
from draftsmith.methods.proposer_base import (
    CatchUpTimer,
    DraftBatch,
    DraftSampling,
    DraftTimer,
    Proposer,
    RowState,
)
from draftsmith.models.attention import cached_attention, slot_kernel_attention
from draftsmith.models.kv_cache import ForwardBatch, UnpackedOnRead
from draftsmith.models.linear import Linear

# the most bytes kept unprojected: plain steps' hidden states (`observe_later`, kept by reference) and, while
# the policy holds, prompts' hidden states (`observe_prompt_later`); those of finished requests are dropped first
MAX_LATER_BYTES = 256 * 2**20


@dataclasses.dataclass
class _Kept:
    """Positions observed but not yet projected, with the forward's hidden states they come from: a plain
    step's (one position a row) or a prefill chunk's (`chunk`; `counts` a row)."""

    slots: list[int]
    generations: list[int]  # each slot's holder when kept: a later holder's positions are not these
    starts: list[int]
    counts: list[int]
    reads: list[int]  # the forward's row each kept row reads (samples sharing a prefill read their leader's)
    nbytes: int  # what keeping it holds in memory
    hidden: Mapping[int, torch.Tensor]
    chunk: bool = False


@dataclasses.dataclass
class _ScratchRow:
    """A row the draft timer drafts for (a `RowState`): its prompt's last token drafts the block."""

    request_id: str
    slot: int
    prompt_token_ids: list[int]
    output_token_ids: list[int] = dataclasses.field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids


def _in_dtype(lm_head: nn.Linear, dtype: torch.dtype) -> nn.Linear:
    """`lm_head` itself where it is in `dtype`, else a copy in it (a `Linear`: the CPU's fast inference path)."""
    if lm_head.weight.dtype == dtype:
        return lm_head
    copy = Linear(lm_head.in_features, lm_head.out_features, bias=lm_head.bias is not None, device="meta")
    copy.weight = nn.Parameter(lm_head.weight.detach().to(dtype), requires_grad=False)
    if lm_head.bias is not None:
        copy.bias = nn.Parameter(lm_head.bias.detach().to(dtype), requires_grad=False)
    return copy


class DFlashProposer(Proposer):
    per_token_drafts = False  # one draft forward a step, whatever the block's width

    def __init__(self, config, target, max_num_seqs: int, max_model_len: int):
        super().__init__(config, target, max_num_seqs, max_model_len)
        weight = target.model.embed_tokens.weight
        self.device = weight.device
        self.dtype = draft_dtype(config.draft_dtype, weight.dtype, self.device)
        self.head = load_attached_head(config, target, self.dtype)
        pack_draft_weights(config.draft_dtype, [self.head], target)
        # the drafts' logits come from the target's LM head run in the draft dtype (a copy where they differ):
        # drafts are only proposals, and in fp32 that GEMM over the vocabulary was a fifth of a propose
        self.lm_head = _in_dtype(target.lm_head, self.dtype)
        self.feature_layers = self.head.feature_layers
        self.block_size = self.head.config.block_size
        # a windowed head's block query reads the newest `window` positions up to its own: of a prompt, the
        # engine hands over only those (`observe_window`), and a chunk may start past the positions observed
        # before it
        self.window = self.head.config.sliding_window
        self.observe_window = self.window
        # a block of block_size tokens a row through the draft layers, the LM head on its drafts
        self.draft_query_len = self.block_size
        self.draft_cost_guess = self.head.config.num_hidden_layers / target.config.num_hidden_layers
        self.k = config.num_speculative_tokens
        self.cache = self.head.make_cache(max_num_seqs, max_model_len + self.block_size)
        self.head.init_rope(max_model_len + self.block_size, self.device)  # a block may run past max_model_len
        # per slot: the request whose context it holds and the end of its written positions (all of 0..n-1, or a
        # window's newest); `observed_end`: the end of its observed ones, written or kept for later
        self.owner: list[str | None] = [None] * max_num_seqs
        self.context_len = [0] * max_num_seqs
        self.observed_end = [0] * max_num_seqs
        # per slot, bumped whenever it changes hands: kept plain steps of an earlier holder are stale (a request
        # id may come back in the same slot)
        self.generation = [0] * max_num_seqs
        self.draft_tokens = torch.full((max_num_seqs, self.k), -1, dtype=torch.long, device=self.device)
        self.draft_counts = torch.zeros(max_num_seqs, dtype=torch.long, device=self.device)
        self.draft_probs: torch.Tensor | None = None
        # a static tree, or EAGLE-2's dynamic one grown from the block's per-depth distributions (draft_trees);
        # their depth is checked against the block at load
        self.tree = configured_tree(config, self.k)
        if self.tree is not None:
            self.draft_parents = torch.full((max_num_seqs, self.k), -1, dtype=torch.long, device=self.device)
            self.confidence = torch.zeros(max_num_seqs, self.k, device=self.device)
        # positions not yet projected (plain steps' and, while the policy holds, prompts'), and per slot how
        # many of them are its current request's
        self._later: list[_Kept] = []
        self._kept = [0] * max_num_seqs
        self._later_bytes = 0

    def readout(self, hidden: torch.Tensor) -> torch.Tensor:
        """The drafts' fp32 logits [.., V] from the head's final hidden states, through the target's LM head in
        the draft dtype (`lm_head`)."""
        return self.lm_head(hidden.to(self.dtype)).float()

    def draft_models(self) -> list[torch.nn.Module]:
        return [self.head, self.lm_head]

    def features(self, hidden_states):
        return self.head.features(hidden_states).to(self.dtype)

    def observe_later(self, rows: Sequence[RowState], starts: list[int], hidden_states) -> bool:
        """Keeps a plain step's hidden states (one position a row) and projects them with the next drafting or
        verified step's, in one batch: projected step by step, a plain step at 8 rows paid 0.66 ms of context
        projection (15% of the step) while the policy kept speculation off (demo, 8 in flight). Only drafting,
        a verified step of a row with kept positions, or MAX_LATER_BYTES kept project them (the budget drops
        finished requests' first): a request that finishes before then never pays for a context it never
        drafts from."""
        size = _nbytes(hidden_states)
        if not self._make_room(size):
            self._replay()
        slots = [r.slot for r in rows]
        for slot, start in zip(slots, starts):
            self._check_continues(slot, start, 1)
        self._later.append(_Kept(slots, [self.generation[s] for s in slots], list(starts), [1] * len(slots),
                                 list(range(len(slots))), size, hidden_states))
        self._later_bytes += size
        for slot, start in zip(slots, starts):
            self._kept[slot] += 1
            self.observed_end[slot] = start + 1
        return True

    def observe_prompt_later(self, rows: Sequence[RowState], starts: list[int], counts: list[int],
                             hidden_states: Mapping[int, torch.Tensor], reads: list[int] | None = None) -> bool:
        """Keeps a prefill chunk's hidden states (as the forward left them: a packed forward's unread) while the
        policy holds plain decoding; their features are made and projected with the next replay: at 8 in
        flight a held DFlash head had paid 4% of the run projecting prompts it never drafted from, and 1.5% of
        its prefill time making their features. Kept within MAX_LATER_BYTES; past it, False (the caller
        projects it now)."""
        size = _nbytes(hidden_states)
        if not self._make_room(size):
            return False
        for row, start, count in zip(rows, starts, counts):
            self._claim(row)
            self._check_continues(row.slot, start, count)
        slots = [r.slot for r in rows]
        reads = list(range(len(slots))) if reads is None else list(reads)
        self._later.append(_Kept(slots, [self.generation[s] for s in slots], list(starts), list(counts), reads,
                                 size, hidden_states, chunk=True))
        for slot, start, count in zip(slots, starts, counts):
            self._kept[slot] += count
            self.observed_end[slot] = start + count
        self._later_bytes += size
        return True

    def _check_continues(self, slot: int, start: int, count: int) -> None:
        """Observed positions continue the slot's earlier ones; a windowed head's may start past them where the
        positions skipped are older than any window reads (`count` at least the window: a prompt chunk's newest)."""
        end = self.observed_end[slot]
        if start == end or (self.window is not None and start > end and count >= self.window):
            return
        raise DraftsmithError("observed positions must continue each request's earlier ones")

    def _make_room(self, size: int) -> bool:
        """Whether `size` more bytes fit in MAX_LATER_BYTES, once what finished requests left is dropped."""
        if self._later_bytes + size > MAX_LATER_BYTES:
            self._later = [kept for kept in self._later if self._live(kept)]
            self._later_bytes = sum(kept.nbytes for kept in self._later)
        return self._later_bytes + size <= MAX_LATER_BYTES

    def _claim(self, row: RowState) -> None:
        """The slot's context becomes `row`'s request's (empty) if it held another's."""
        if self.owner[row.slot] != row.request_id:
            self.owner[row.slot], self.context_len[row.slot], self.observed_end[row.slot] = row.request_id, 0, 0
            self.generation[row.slot] += 1
            self._kept[row.slot] = 0

    def _live(self, kept: _Kept) -> list[int]:
        return [i for i, (slot, gen) in enumerate(zip(kept.slots, kept.generations)) if self.generation[slot] == gen]

    def unfed_rows(self, rows: Sequence[RowState]) -> list[int]:
        """Rows whose prompt was kept unprojected while the policy held (`observe_prompt_later`): their context
        holds none of their positions yet, and its first projection serves every later draft of the request."""
        return [b for b, r in enumerate(rows)
                if self.owner[r.slot] == r.request_id and not self.context_len[r.slot] and self._kept[r.slot]]

    def catch_up(self, rows: Sequence[RowState]) -> tuple[int, int]:
        # a verified step's positions are projected as it is observed, so a steady draft projects none; the
        # plain steps kept since the last replay are the catch-up (those of a slot's earlier requests are not)
        owed = [self._kept[r.slot] for r in rows if self._kept[r.slot]]
        return len(owed), max(owed, default=0)

    def catch_up_timer(self) -> CatchUpTimer:
        """A catch-up is `_write_context` over the kept positions (fc, norm, every layer's k/v), no block
        forward: 600 kept prompt positions take a few ms. Priced as a draft forward per position instead, from
        the slope of short catch-ups (mostly fixed cost), one was priced 40-80 ms on the demo and held DFlash
        plain for whole requests at one in flight. Random features go into slots 0..rows-1 from position 0:
        before admission, and a request's context is written from its position 0 before it is read. They are
        drawn once per larger shape, on that shape's first (untimed) run, so the table prices the projection
        alone."""
        width = len(self.feature_layers) * self.head.config.target_hidden_size
        dtype = self.head.target.model.embed_tokens.weight.dtype
        scratch = torch.empty(0, 0, width, dtype=dtype, device=self.device)

        @torch.inference_mode()
        def project(rows: int, positions: int) -> None:
            nonlocal scratch
            if rows > scratch.shape[0] or positions > scratch.shape[1]:
                grown = (max(rows, scratch.shape[0]), max(positions, scratch.shape[1]), width)
                scratch = torch.randn(grown, dtype=dtype, device=self.device)
            self._write_context(list(range(rows)), [0] * rows, [positions] * rows, scratch[:rows, :positions])

        return CatchUpTimer(project, self.cache.max_len, self.device)

    def draft_timer(self, context: int) -> DraftTimer | None:
        """A steady draft step as served: the block forward over `context` positions a row and the chain
        (DSpark's Markov term and confidence with it), on random features written into slots 0..rows-1 as their
        context (on the first, untimed, run of each larger shape), before admission; `done` releases the slots.
        Priced as the target's forward of a block a row times the ratio of their layers, the demo DSpark head's
        step was priced 4.2 ms at 8 rows where it took 7 and 1.6 ms at one where it took 2.5-3. Trees are left
        to the live timings (their width is sized after drafting)."""
        context = min(context, self.cache.max_len - self.block_size - 1)
        if self.tree is not None or context < 1:
            return None
        width = len(self.feature_layers) * self.head.config.target_hidden_size
        dtype = self.head.target.model.embed_tokens.weight.dtype
        vocab = self.head.config.vocab_size
        made: list[_ScratchRow] = []

        @torch.inference_mode()
        def draft(rows: int) -> None:
            while len(made) < rows:
                slot = len(made)
                row = _ScratchRow(f"draft-timer-{slot}", slot, [(7 * slot + 1) % vocab] * (context + 1))
                features = torch.randn(1, context, width, dtype=dtype, device=self.device)
                self.observe([row], [0], [context], features)
                made.append(row)
            self.propose(made[:rows], [self.k] * rows)

        def done() -> None:
            for row in made:
                self.release(row)
            made.clear()

        return DraftTimer(draft, done, self.device)

    @torch.inference_mode()
    def _replay(self) -> None:
        """Projects the kept positions: each prompt chunk as one batch, then the plain steps', all rows and steps
        as one batch of single positions (a slot's prompt comes before its plain steps); rows released since
        are skipped."""
        if not self._later:
            return
        later, self._later = self._later, []
        self._kept = [0] * len(self._kept)
        self._later_bytes = 0
        slots, positions, features = [], [], []
        expected = {}
        for kept in later:
            live = self._live(kept)
            if not live:
                continue
            for i in live:  # checked as they were kept (`_check_continues`)
                expected[kept.slots[i]] = kept.starts[i] + kept.counts[i]
            reads = torch.tensor([kept.reads[i] for i in live], device=self.device)
            if kept.chunk:
                counts = [kept.counts[i] for i in live]
                self._write_context([kept.slots[i] for i in live], [kept.starts[i] for i in live], counts,
                                    self.features(kept.hidden)[reads, : max(counts)])
                continue
            slots += [kept.slots[i] for i in live]
            positions += [kept.starts[i] for i in live]
            features.append(self.features(kept.hidden)[reads])
        if slots:
            self._write_context(slots, positions, [1] * len(slots), torch.cat(features))
        for slot, end in expected.items():
            self.context_len[slot] = end

    def _write_context(self, slots: list[int], starts: list[int], counts: list[int], features: torch.Tensor) -> None:
        batch = ForwardBatch.build(slots, starts, counts, self.cache, None, self.device)
        for layer, (keys, values) in enumerate(self.head.context_kv(features, batch.positions)):
            batch.write(self.cache.k[layer], keys)
            batch.write(self.cache.v[layer], values)

    @torch.inference_mode()
    def observe(self, rows: Sequence[RowState], starts: list[int], counts: list[int], features: torch.Tensor) -> None:
        # kept positions go first where they come before these (a prefill's new requests have none)
        if any(self._kept[r.slot] and self.owner[r.slot] == r.request_id for r in rows):
            self._replay()
        for row, start, count in zip(rows, starts, counts):
            self._claim(row)
            self._check_continues(row.slot, start, count)
        slots = [r.slot for r in rows]
        self._write_context(slots, starts, counts, features[:, : max(counts)])
        for slot, start, count in zip(slots, starts, counts):
            self.context_len[slot] = self.observed_end[slot] = start + count

    @torch.inference_mode()
    def propose(self, rows: Sequence[RowState], max_drafts: list[int], sampling: DraftSampling | None = None,
                stop_below: float = 0.0) -> DraftBatch:
        n = len(rows)
        tokens_out, counts_out, probs_out = self.cleared_outputs(n, sampling, self.head.config.vocab_size)
        sampled = probs_out is not None
        steady = not any(self._kept)  # live kept plain steps projected first are a catch-up, priced apart
        self._replay()
        active = [b for b in range(n) if max_drafts[b] > 0]
        if not active:
            return DraftBatch(tokens_out, counts_out, probs_out, steady=steady)
        limits = [min(max_drafts[b], self.k) for b in active]
        # a tree reads every depth it may reach; a chain the longest row's drafts
        width = max(limits) if self.tree is None else self.tree.max_depth
        slots = [rows[b].slot for b in active]
        starts = [rows[b].num_tokens - 1 for b in active]  # the last token's position: the block's first
        for b, start in zip(active, starts):
            if self.owner[rows[b].slot] != rows[b].request_id or self.context_len[rows[b].slot] != start:
                raise DraftsmithError(f"request {rows[b].request_id}: the DFlash context does not reach the block")
        size = self.block_size
        outputs = self.head.config.draft_slots(width)  # the last layer's queries
        batch = ForwardBatch.build(slots, starts, [size] * len(active), self.cache, None, self.device)
        # not causal within the block: every block token sees every key up to the block's end
        keys = torch.arange(batch.kv_start, batch.kv_len, device=self.device)
        ends = torch.tensor(starts, device=self.device) + size - 1
        seen = (keys[None, :] <= ends[:, None])[:, None, :]
        if self.window is not None:  # and a windowed one the newest `window` positions up to its own
            seen = seen & (keys[None, None, :] > batch.positions[:, :, None] - self.window)
        mask = seen[:, None].expand(-1, 1, size, -1)
        batch = dataclasses.replace(batch, mask=mask)
        if self.window is not None and batch.slot_rows is not None:  # the slot kernel's form of that window
            whole_block = torch.ones(len(active), size, size, dtype=torch.bool, device=self.device)
            block_starts = torch.tensor(starts, device=self.device)

        def attend(layer, q, k, v):
            batch.write(self.cache.k[layer], k)
            batch.write(self.cache.v[layer], v)
            queried = slice(None) if q.shape[2] == size else outputs
            if batch.slot_rows is None:
                return cached_attention(q, batch.read(self.cache.k[layer]), batch.read(self.cache.v[layer]),
                                        batch.mask[:, :, queried], batch.memo)
            if self.window is None:  # a slot kernel: a causal mask at the block's end is the block's
                return slot_kernel_attention(q, self.cache.k[layer], self.cache.v[layer], batch.read_slots,
                                             ends[:, None].expand(-1, q.shape[2]), batch.slot_rows.kv_lens)
            # windowed: each query's window ends at its own position, and the whole block is a "tree" it sees
            return slot_kernel_attention(q, self.cache.k[layer], self.cache.v[layer], batch.read_slots,
                                         batch.positions[:, queried], batch.slot_rows.kv_lens, window=self.window,
                                         tree_mask=whole_block[:, queried], block_starts=block_starts)

        last = torch.tensor([(rows[b].output_token_ids or rows[b].prompt_token_ids)[-1] for b in active],
                            device=self.device)
        hidden = self.head.block_forward(self.head.embed_block(last[:, None]), batch.positions, attend,
                                         outputs=outputs)
        if self.tree is not None:
            return dataclasses.replace(self._tree(self.readout(hidden), active, limits, n), steady=steady)
        temperature, generators = None, {}
        if sampled:
            temperature = sampling.temperature.to(self.device)[torch.tensor(active, device=self.device)]
            temps = sampling.temperature.tolist()
            generators = {j: sampling.generators[b] for j, b in enumerate(active) if temps[b] > 0}
        rows_t = torch.tensor(active, device=self.device)
        counts_out[rows_t] = torch.tensor(limits, device=self.device)
        confidence = self._chain(hidden, last, limits, rows_t, temperature, generators, tokens_out, probs_out)
        return DraftBatch(tokens_out, counts_out, probs_out, confidence=confidence, forwards=1, steady=steady)

    def _chain(self, hidden: torch.Tensor, last: torch.Tensor, limits: list[int], rows: torch.Tensor,
               temperature: torch.Tensor | None, generators: dict[int, torch.Generator], tokens_out: torch.Tensor,
               probs_out: torch.Tensor | None) -> torch.Tensor | None:
        """Drafts the chains of the drafting rows from their blocks' final hidden states [A, width, H] (`last`
        [A]: each row's token before the block) into `rows` of the outputs -> the chance each draft survives
        verification [n, k], or None where the head does not say (DFlash's does not)."""
        logits = self.readout(hidden)  # [rows, width, V]: one block forward drafts them all
        choose_block(logits, limits, rows, temperature, generators, tokens_out, probs_out)
        return None

    def _tree(self, logits: torch.Tensor, active: list[int], limits: list[int], n: int) -> DraftBatch:
        """The active rows' trees from their blocks' logits [A, depth, V], each cut to its row's limit (its
        first nodes, a tree). A dynamic tree's nodes come likeliest first, with their paths' chances, so the
        engine may verify the first w (`size_trees`); a static one is verified whole."""
        dynamic = isinstance(self.tree, TreeShape)
        if dynamic:
            tokens, parents, scores = marginal_tree(logits, self.tree)
        else:
            tokens = static_marginal_tree(logits, self.tree)
            parents = self.tree.parent_tensor(len(active), self.device)
        rows_t = torch.tensor(active, device=self.device)
        limit = torch.tensor(limits, device=self.device)
        keep = torch.arange(self.k, device=self.device)[None, :] < limit[:, None]
        self.draft_tokens[rows_t] = tokens.masked_fill(~keep, -1)
        self.draft_counts[rows_t] = limit
        parents_out, confidence = self.draft_parents[:n], None
        parents_out.fill_(-1)
        parents_out[rows_t] = parents
        if dynamic:
            confidence = self.confidence[:n]
            confidence.zero_()
            confidence[rows_t] = scores.exp().masked_fill(~keep, 0.0)
        return DraftBatch(self.draft_tokens[:n], self.draft_counts[:n], None, parents_out, confidence, forwards=1)

    def release(self, request: RowState) -> None:
        if request.slot is not None and self.owner[request.slot] == request.request_id:
            self.owner[request.slot] = None
            self.generation[request.slot] += 1
            self._kept[request.slot] = 0  # its kept steps are stale: skipped at the replay, owed by no one


def _nbytes(hidden_states: Mapping[int, torch.Tensor]) -> int:
    """What keeping a forward's hidden states holds in memory (a packed forward's `UnpackedOnRead` its own)."""
    if isinstance(hidden_states, UnpackedOnRead):
        return hidden_states.nbytes
    return sum(h.numel() * h.element_size() for h in hidden_states.values())
