"""What the engine knows of a proposer: the `Proposer` contract, the `DraftBatch` it returns and the row
state it reads. It lives beside the method contract, not in `serve`, so that a method's folder depends on
this package and on `draftsmith.models`, never on the engine that consumes it."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple, Protocol

import torch

from draftsmith.methods.speculative_config import SpeculativeConfig


@dataclass
class DraftBatch:
    """One step's drafts for B rows, as device tensors (usually views of a proposer's persistent buffers,
    valid until its next `propose`).

    Row b drafted `counts[b]` tokens, `tokens[b, :counts[b]]`; the rest of the row is -1. With `parents`,
    the drafts of a row form a tree: `parents[b, i]` is the index of draft i's parent, -1 for the token the
    row last verified; without it they form a chain (parent of i is i - 1).
    """

    tokens: torch.Tensor  # [B, K] long
    counts: torch.Tensor  # [B] long
    probs: torch.Tensor | None = None  # [B, K, V] q over the target vocab, for sampled drafts; None = one-hot
    parents: torch.Tensor | None = None  # [B, K] long, tree drafts only
    # [B, K] the drafter's chance that each node's path is accepted, for a tree whose nodes come likeliest
    # first: the engine verifies the first w of them, w sized by the cost model (tree_verify.size_trees)
    confidence: torch.Tensor | None = None
    # what drafting cost, for the policy's cost model: the draft units this propose ran (sequential forwards,
    # or Medusa heads; 1 for a one-pass drafter: `Proposer.per_token_drafts`), and
    # whether it was steady (False: it also caught up over a prompt or a pause, a one-off priced apart)
    forwards: int = 0
    steady: bool = True


class RowState(Protocol):
    """What a proposer may read of a running request (the engine's `Request` provides it)."""

    request_id: str
    slot: int
    prompt_token_ids: list[int]
    output_token_ids: list[int]

    @property
    def num_tokens(self) -> int: ...

    def all_token_ids(self) -> list[int]: ...


class DraftSampling(Protocol):
    """Per-row sampling settings a sampling proposer reads (the engine's `SamplingBatch` provides them)."""

    temperature: torch.Tensor  # [B] fp32, 0 = greedy
    generators: list[torch.Generator]
    all_greedy: bool


class DraftTimer(NamedTuple):
    """A proposer's steady drafting as the policy times it (`Proposer.draft_timer`)."""

    # one draft step of `rows` rows (slots 0..rows-1) over a context the timer wrote itself, before admission
    run: Callable[[int], None]
    done: Callable[[], None]  # leaves the slots as the timing found them
    device: torch.device


class CatchUpTimer(NamedTuple):
    """A proposer's catch-up as the policy times it (`Proposer.catch_up_timer`)."""

    # one catch-up of (rows, positions each), on scratch state, before admission; rows up to the engine's slots
    run: Callable[[int, int], None]
    most_positions: int
    device: torch.device


class Proposer:
    """Drafts tokens for the rows being decoded; returned by its method's `proposer_class()`.

    The engine's cost model reads about drafting: `per_token_drafts` (each further draft token costs one more
    draft unit: a sequential draft forward, as in EAGLE, or a head, as in Medusa; False when one pass drafts
    any width at one cost, as n-gram lookup, DFlash or parallel drafting do), `propose_first` (drafting is so
    cheap that the engine drafts before it sizes the step, so it knows which rows have drafts at all), and what each `propose` returns: its DraftBatch's
    `forwards` and `steady`.
    """

    per_token_drafts: ClassVar[bool] = True
    propose_first: ClassVar[bool] = False

    def __init__(self, config: SpeculativeConfig, target, max_num_seqs: int, max_model_len: int):
        self.config = config
        # HF hidden_states indices it needs from every target forward (a head-based proposer takes them from
        # its loaded head); read only when its method declares needs.hidden_states
        self.feature_layers: tuple[int, ...] = ()
        # observe() keeps at most this many newest positions per row (None: all): the engine hands over no
        # more, instead of building a whole prompt's features
        self.observe_window: int | None = None
        # a draft LM's folder, whose tokenizer the engine checks against the target's (None: drafts in the
        # target's own ids)
        self.tokenizer_dir: str | None = None
        # what one draft forward costs, for the policy's first guess: about `draft_cost_guess` (None: the
        # policy's default for a one-layer head) times the target's forward of `draft_query_len` tokens a row
        self.draft_query_len = 1
        self.draft_cost_guess: float | None = None
        # set where it drafts trees (DraftBatch.parents): the policy's chain width does not cap their nodes
        self.tree = None
        # runs the one-token draft steps at static shapes (`use_static_steps`); None: eager
        self.draft_steps = None

    def use_static_steps(self, make_runner: Callable[[torch.nn.Module, Any], Any]):
        """Where drafting runs one head one token a row at a time after a first forward (EAGLE drafts 2..k),
        runs those steps with `make_runner(head, its KV cache)` (`serve.engine.step_graphs.DraftStepRunner`,
        at static shapes; `models.draft_step_cpu.FusedDraftSteps`, one C++ op each, whose `catch_up` runs the
        first forward too) from now on and returns that runner (None where `make_runner` gives none); None
        where it drafts no such steps."""
        return None

    def draft_models(self) -> list[torch.nn.Module]:
        """The networks it drafts with (none for lookup methods): the engine compiles their kernels at start."""
        return []

    def propose(self, rows: Sequence[RowState], max_drafts: list[int], sampling: DraftSampling | None = None,
                stop_below: float = 0.0) -> DraftBatch:
        """Up to `max_drafts[b]` tokens for row b. `sampling` is given when drafts should be sampled (the
        config's draft_sample_method is probabilistic); greedy rows still take the argmax. `stop_below`, the
        policy's confidence floor: a proposer that knows its confidence stops drafting once the batch's mean
        chance of reaching the next draft (running products of the drafts' probabilities, 0 for rows not
        drafting) falls below it (0: draft up to the limits)."""
        raise NotImplementedError

    def cleared_outputs(self, n: int, sampling: DraftSampling | None, vocab_size: int):
        """(tokens [n, k] all -1, counts [n] all 0, probs [n, k, V] all 0 or None where no row samples): the first n
        rows of the proposer's own `draft_tokens`/`draft_counts` buffers, and of `draft_probs`, made on the first
        sampled propose (for proposers that keep those three and write every drafted q)."""
        tokens, counts = self.draft_tokens[:n], self.draft_counts[:n]
        tokens.fill_(-1)
        counts.zero_()
        if sampling is None or sampling.all_greedy:
            return tokens, counts, None
        if self.draft_probs is None:
            self.draft_probs = torch.zeros(self.draft_tokens.shape + (vocab_size,), device=self.draft_tokens.device)
        probs = self.draft_probs[:n]
        probs.zero_()
        return tokens, counts, probs

    def catch_up(self, rows: Sequence[RowState]) -> tuple[int, int]:
        """(how many of these rows must first feed the draft model more positions than one verify step
        brings (k + 1): new rows, or rows resuming after steps without speculation; the most extra positions
        any of them has). The policy prices that catch-up."""
        return 0, 0

    def unfed_rows(self, rows: Sequence[RowState]) -> list[int]:
        """Indices of these rows whose drafter holds none of their positions yet: a draft model is fed a new
        request's prompt at its first draft, a catch-up that serves every later draft of the request, which
        the policy prices over the request's remaining steps. None for proposers fed at prefill."""
        return []

    def catch_up_model(self) -> tuple[torch.nn.Module, str] | None:
        """(model, its folder) where catch-ups run a whole language model that the forward-cost profile can
        time (a draft model): the policy prices them by that model's own table. None: priced from the
        target's table."""
        return None

    def draft_timer(self, context: int) -> DraftTimer | None:
        """Where a draft forward's cost grows with the rows otherwise than the target's forward of
        `draft_query_len` tokens does: how to run one over `context` positions a row (a one-pass drafter's
        steady step, `per_token_drafts` False; a per-token drafter's one-token step), which the policy times by
        rows into the table that prices drafting. None: drafting is priced as `draft_cost_guess` times the
        target's forward until it is timed live."""
        return None

    def catch_up_timer(self) -> CatchUpTimer | None:
        """Where a catch-up runs no draft forward but a projection of its own (a block drafter writing kept
        target features into its context): how to run one, which the policy times over a grid into the table
        that prices catch-ups. None: priced otherwise."""
        return None

    def features(self, hidden_states: dict[int, torch.Tensor]) -> torch.Tensor:
        """[B, Q, F] features from a target forward's hidden states (only if `feature_layers`)."""
        raise NotImplementedError

    def observe(self, rows: Sequence[RowState], starts: list[int], counts: list[int], features: torch.Tensor) -> None:
        """Target features [B, Q, F] of the rows' newly verified positions: row b's positions
        starts[b]..starts[b] + counts[b] - 1 are features[b, :counts[b]]."""

    def observe_later(self, rows: Sequence[RowState], starts: list[int], hidden_states) -> bool:
        """A plain decode step's hidden states (one position per row, from `starts`), which the proposer may
        keep and observe only once it drafts again; False: it takes them now, through `observe`."""
        return False

    def observe_prompt_later(self, rows: Sequence[RowState], starts: list[int], counts: list[int],
                             hidden_states, reads: list[int] | None = None) -> bool:
        """A prefill chunk's hidden states (the forward's, by layer: row reads[b] is rows[b]'s, row b where
        `reads` is None; `features` makes what `observe` takes of them), handed over while the policy holds
        plain decoding: the proposer may keep them and feed its head only once it drafts again, so that a
        request that never drafts never pays for them; False: it takes them now, through `observe`."""
        return False

    def release(self, request: RowState) -> None:
        """The request finished or was aborted: drop whatever was kept for it."""

    def metrics(self) -> dict:
        """Numbers of its own for the engine's metrics (a cache's size), if any."""
        return {}

    def forget(self) -> None:
        """Drops what it learned from earlier requests (a benchmark's rounds then start alike)."""
