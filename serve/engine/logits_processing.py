"""What a request asks of its logits before a token is chosen, in vLLM's order and meaning, exact under
speculation.

1. allowed_token_ids and bad_words ban tokens (-inf), min_tokens bans EOS and the stop token ids while the
   output is shorter, logit_bias adds to logits;
2. then the penalties: repetition_penalty on tokens in the prompt or output (a positive logit divided by it,
   a negative one multiplied), frequency_penalty times each token's output count subtracted, presence_penalty
   subtracted from every token the output holds.
Greedy rows take their argmax after this; min_p belongs with temperature, top-k and top-p
(`sampling.logits_to_probs`).

Under speculation a verify forward scores positions 0..k of a row, and position j is read only when drafts
0..j-1 were all accepted: it is processed as if they were already output (their counts, their length toward
min_tokens, the tail a bad word's first tokens must match). A tree node sees the drafts on its path. So every
position is processed as plain decoding would process it there, and outputs are the same token for token.

Counts live per cache slot (`SlotLogitsState`), brought up to date once a step with the tokens each row
gained since: the step's work is a few batched tensor operations, whatever the rows ask.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from draftsmith.serve.engine.sampling_params import SamplingParams
from draftsmith.serve.engine.structured_outputs import GrammarRow, GrammarTime


@dataclass(frozen=True)
class DraftPrefix:
    """The drafted tokens each scored position follows: tokens [B, P] (-1 padding), follows [B, N, P] bool
    (position n comes after token p)."""

    tokens: torch.Tensor
    follows: torch.Tensor

    @classmethod
    def chain(cls, tokens: torch.Tensor, positions: int) -> DraftPrefix:
        """Positions 0..positions-1 of a chain: position n follows tokens 0..n-1."""
        tokens = tokens[:, : positions - 1]
        order = torch.ones(positions, tokens.shape[1], dtype=torch.bool, device=tokens.device).tril(-1)
        return cls(tokens, order.expand(tokens.shape[0], -1, -1))

    @classmethod
    def tree(cls, ids: torch.Tensor, seen: torch.Tensor) -> DraftPrefix:
        """A tree block: ids [B, Q] (column 0 the last verified token), seen [B, Q, Q] (a column sees itself
        and its ancestors): a column follows the nodes on its path, itself included, past the root."""
        return cls(ids[:, 1:], seen[:, :, 1:])

    def depth(self) -> torch.Tensor:
        """[B, N]: drafted tokens before each position."""
        return self.follows.sum(-1)

    def counts(self, vocab: int) -> torch.Tensor:
        """[B, N, V] float: how often each token occurs among the drafts before each position."""
        rows, positions, drafts = self.follows.shape
        counts = torch.zeros(rows, positions, vocab, device=self.tokens.device)
        index = self.tokens.clamp(min=0)[:, None, :].expand(rows, positions, drafts)
        return counts.scatter_add_(2, index, self.follows.float())

    def paths(self) -> list[list[list[int]]]:
        """Per row and position, the drafted tokens before it in order, on the host (drafts come after their
        ancestors in a block, so column order is path order)."""
        tokens, follows = self.tokens.tolist(), self.follows.tolist()
        return [[[t for t, f in zip(row_tokens, position) if f] for position in row_follows]
                for row_tokens, row_follows in zip(tokens, follows)]


@dataclass(frozen=True)
class LogitsAdjust:
    """One step's processing for its rows, as tensors: built by `SlotLogitsState.adjust`."""

    bias: torch.Tensor  # [B, V]: logit_bias, and -inf for tokens not allowed and single-token bad words
    min_tokens_left: torch.Tensor  # [B] long: output tokens still due before a stop token may come
    stop_tokens: torch.Tensor  # [B, V] bool: EOS and the row's stop_token_ids
    output_counts: torch.Tensor  # [B, V] float: the output so far
    in_prompt: torch.Tensor  # [B, V] bool: tokens of the prompt (rows with a repetition penalty)
    repetition: torch.Tensor  # [B]
    frequency: torch.Tensor  # [B]
    presence: torch.Tensor  # [B]
    penalized: bool
    bans_stops: bool
    # per row, the bad words of two or more tokens, and the output's last tokens they must match
    bad_sequences: tuple[tuple[tuple[int, ...], ...], ...]
    tails: tuple[tuple[int, ...], ...]
    grammars: tuple[GrammarRow | None, ...] = ()  # per row, its structured-output matcher, or None

    def select(self, rows: list[int]) -> LogitsAdjust:
        index = torch.tensor(rows, device=self.bias.device)
        tensors = {name: getattr(self, name)[index] for name in (
            "bias", "min_tokens_left", "stop_tokens", "output_counts", "in_prompt", "repetition", "frequency",
            "presence")}
        return replace(self, **tensors, bad_sequences=tuple(self.bad_sequences[r] for r in rows),
                       tails=tuple(self.tails[r] for r in rows),
                       grammars=tuple(self.grammars[r] for r in rows) if self.grammars else ())

    def apply(self, logits: torch.Tensor, prefix: DraftPrefix | None = None) -> torch.Tensor:
        """logits [B, N, V] of N consecutive positions (position n after the drafts `prefix` says; without
        one, N is 1) -> processed logits, fp32."""
        rows, positions, vocab = logits.shape
        logits = logits.float() + self.bias[:, None]
        if any(g is not None for g in self.grammars):
            logits = self._grammar_masks(logits, prefix)
        depth = prefix.depth() if prefix is not None else torch.zeros(rows, positions, dtype=torch.long,
                                                                      device=logits.device)
        if self.bans_stops:
            early = depth < self.min_tokens_left[:, None]  # [B, N]
            logits = logits.masked_fill(early[:, :, None] & self.stop_tokens[:, None], float("-inf"))
        if any(self.bad_sequences):
            logits = self._ban_sequences(logits, prefix)
        if self.penalized:
            counts = self.output_counts[:, None].expand(rows, positions, vocab)
            if prefix is not None:
                counts = counts + prefix.counts(vocab)
            seen = counts > 0
            repeated = seen | self.in_prompt[:, None]
            penalty = self.repetition[:, None, None]
            logits = torch.where(repeated, torch.where(logits > 0, logits / penalty, logits * penalty), logits)
            logits = logits - self.frequency[:, None, None] * counts - self.presence[:, None, None] * seen
        # a position where nothing is left (a finished grammar that allows only EOS, under min_tokens) may stop:
        # its stop tokens come back, rather than an argmax over nothing
        dead = torch.isneginf(logits).all(dim=-1, keepdim=True)
        return torch.where(dead & self.stop_tokens[:, None], 0.0, logits)

    def _grammar_masks(self, logits: torch.Tensor, prefix: DraftPrefix | None) -> torch.Tensor:
        """-inf on the tokens each row's grammar forbids after each position's drafts."""
        rows, positions, vocab = logits.shape
        paths = prefix.paths() if prefix is not None else [[[]] for _ in range(rows)]
        allowed = torch.ones(rows, positions, vocab, dtype=torch.bool)
        for row, grammar in enumerate(self.grammars):
            if grammar is not None:
                allowed[row] = grammar.masks(paths[row][:positions])
        return logits.masked_fill(~allowed.to(logits.device), float("-inf"))

    def _ban_sequences(self, logits: torch.Tensor, prefix: DraftPrefix | None) -> torch.Tensor:
        """-inf on a bad word's last token wherever the tokens before the position end with its others."""
        paths = prefix.paths() if prefix is not None else [[[]] for _ in self.tails]
        banned = []
        for row, (sequences, tail) in enumerate(zip(self.bad_sequences, self.tails)):
            for position in range(logits.shape[1]):
                history = list(tail) + (paths[row][position] if position < len(paths[row]) else [])
                banned += [(row, position, seq[-1]) for seq in sequences
                           if len(history) >= len(seq) - 1 and history[len(history) - len(seq) + 1:] == list(seq[:-1])]
        if banned:
            index = torch.tensor(banned, device=logits.device).T
            logits = logits.index_put((index[0], index[1], index[2]), torch.tensor(float("-inf"), device=logits.device))
        return logits


class SlotLogitsState:
    """Per cache slot, what processing needs of its request: output token counts, the prompt's tokens, the
    static bias. A slot's row is rebuilt when a new request holds it, and its counts are brought up to date
    with each step's new tokens in one scatter."""

    def __init__(self, slots: int, vocab: int, device, eos_token_ids: set[int], tokenizer=None):
        self.slots, self.vocab, self.device, self.tokenizer = slots, vocab, device, tokenizer
        self.eos_token_ids = sorted(eos_token_ids)
        self.owners: list[object | None] = [None] * slots
        self.grammars: list[GrammarRow | None] = [None] * slots
        self.grammar_time = GrammarTime()
        self.counted = [0] * slots  # output tokens of the owner already in `counts`
        self.tensors: dict[str, torch.Tensor] | None = None  # allocated with the first request that needs them

    def _allocate(self) -> dict[str, torch.Tensor]:
        shape, device = (self.slots, self.vocab), self.device
        return {"counts": torch.zeros(shape, device=device), "in_prompt": torch.zeros(shape, dtype=torch.bool, device=device),
                "bias": torch.zeros(shape, device=device), "stops": torch.zeros(shape, dtype=torch.bool, device=device)}

    def adjust(self, rows: list) -> LogitsAdjust | None:
        """The step's processing for `rows` (engine Requests), or None where no row asks for any."""
        params: list[SamplingParams] = [r.params for r in rows]
        if not any(p.adjusts_logits for p in params):
            return None
        if self.tensors is None:
            self.tensors = self._allocate()
        for request in rows:
            if self.owners[request.slot] is not request:
                self._take_slot(request)
        self._count_new_tokens(rows)
        grammars = tuple(self.grammars[r.slot] for r in rows)
        for request, grammar in zip(rows, grammars):
            if grammar is not None:
                grammar.sync(request.output_token_ids)
        slots = torch.tensor([r.slot for r in rows], device=self.device)
        t = self.tensors

        def column(values, dtype=torch.float32):
            return torch.tensor(values, dtype=dtype, device=self.device)

        multi = [tuple(tuple(w) for w in (p.bad_words_token_ids or []) if len(w) > 1) for p in params]
        longest = [max((len(w) for w in words), default=1) - 1 for words in multi]
        return LogitsAdjust(
            bias=t["bias"][slots], stop_tokens=t["stops"][slots], output_counts=t["counts"][slots],
            in_prompt=t["in_prompt"][slots],
            min_tokens_left=column([p.min_tokens - len(r.output_token_ids) for p, r in zip(params, rows)], torch.long),
            repetition=column([p.repetition_penalty for p in params]),
            frequency=column([p.frequency_penalty for p in params]),
            presence=column([p.presence_penalty for p in params]),
            penalized=any(p.penalized for p in params),
            bans_stops=any(p.min_tokens > len(r.output_token_ids) for p, r in zip(params, rows)),
            bad_sequences=tuple(multi), grammars=grammars,
            tails=tuple(tuple(r.output_token_ids[max(0, len(r.output_token_ids) - n):]) if n else ()
                        for r, n in zip(rows, longest)))

    def forced_tokens(self, rows: list, limits: list[int]) -> list[list[int]] | None:
        """Per row, the tokens its grammar allows alone from its output on (up to its limit), or None where no
        row has any: the grammar drafts of `engine.forced_tokens`. Valid once `adjust` synced the rows."""
        grammars = [self.grammars[r.slot] if self.owners[r.slot] is r else None for r in rows]
        if not any(grammars):
            return None
        forced = [grammar.forced_tokens()[:n] if grammar is not None and n else [] for grammar, n in zip(grammars, limits)]
        return forced if any(forced) else None

    def release(self, slot: int) -> None:
        """The slot's request left: what was kept for it goes (its matcher above all)."""
        self.owners[slot], self.grammars[slot] = None, None

    def metrics(self) -> dict:
        return {"grammar_mask_s": self.grammar_time.seconds, "grammar_masks": self.grammar_time.masks}

    def reset_metrics(self) -> None:
        self.grammar_time.seconds, self.grammar_time.masks = 0.0, 0

    def _take_slot(self, request) -> None:
        """The slot's row rebuilt for `request`: no output counted, its prompt's tokens, its static bias."""
        slot, params, t = request.slot, request.params, self.tensors
        self.owners[slot], self.counted[slot] = request, 0
        t["counts"][slot].zero_()
        t["in_prompt"][slot].zero_()
        if params.repetition_penalty != 1:
            t["in_prompt"][slot, torch.tensor(request.prompt_token_ids, device=self.device)] = True
        bias = torch.zeros(self.vocab, device=self.device)
        if params.allowed_token_ids is not None:
            bias.fill_(float("-inf"))[torch.tensor(params.allowed_token_ids, device=self.device)] = 0.0
        for token, value in (params.logit_bias or {}).items():
            bias[int(token)] += value
        for word in params.bad_words_token_ids or []:
            if len(word) == 1:
                bias[word[0]] = float("-inf")
        t["bias"][slot] = bias
        stops = [*([] if params.ignore_eos else self.eos_token_ids), *params.stop_token_ids]  # vLLM's stop set
        self.grammars[slot] = None if params.compiled_grammar is None else GrammarRow(
            params.compiled_grammar, self.tokenizer, self.vocab, self.eos_token_ids, self.grammar_time)
        t["stops"][slot].zero_()
        if stops:
            t["stops"][slot, torch.tensor(stops, device=self.device)] = True

    def _count_new_tokens(self, rows: list) -> None:
        """Adds each penalized row's output tokens since its last count to its slot's counts."""
        slots, tokens = [], []
        for request in rows:
            if request.params.penalized:
                new = request.output_token_ids[self.counted[request.slot]:]
                slots += [request.slot] * len(new)
                tokens += new
                self.counted[request.slot] = len(request.output_token_ids)
        if tokens:
            index = (torch.tensor(slots, device=self.device), torch.tensor(tokens, device=self.device))
            self.tensors["counts"].index_put_(index, torch.ones(len(tokens), device=self.device), accumulate=True)
