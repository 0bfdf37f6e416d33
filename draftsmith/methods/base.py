"""What a speculation method is: the plugin contract between a method's folder and the rest of draftsmith.

A method is one registered `SpecMethod` subclass. Its class body is declarative and cheap to import (a
pydantic section for `--speculative-config`, a recipe section, its head type, its declared `MethodNeeds`),
so the registry can list every method without importing the engine or the trainer. The heavy parts it
owns (its `Proposer`, its training objective, its converter formats) are returned by the class's hooks,
which import them from the method's own folder only when a layer asks: the engine asks for proposers,
the trainer for objectives, `draftsmith convert` for formats. `train` and `convert` therefore never load
serving code, and serving never loads training code.

The engine talks to proposers only through `Proposer` and `DraftBatch` below; they live here, beside the
method contract, rather than in `serve`, so that a method's folder depends on this module and on
`draftsmith.models`, never on the engine that consumes it.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Protocol

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from draftsmith.errors import DraftsmithError
from draftsmith.methods.token_tree import TokenTree


@dataclass(frozen=True)
class MethodNeeds:
    """What a method declares about itself; the engine and config checks read these flags, never method names.

    Read today: `hidden_states` (the engine hands the proposer target features), `draft_probs` (whether
    draft_sample_method "probabilistic" is allowed), `head` ("model" required), `parallel` (the bench drafts a
    shipped head's whole block). `own_kv_cache` and `tree` (its config section takes tree keys; the engine
    reads trees from `DraftBatch.parents`) are declared only: nothing reads them yet."""

    hidden_states: bool = False  # needs target features from every forward (EAGLE family, MTP)
    draft_probs: bool = False  # can sample its drafts and hand back q (draft_sample_method=probabilistic)
    own_kv_cache: bool = False  # keeps a per-slot cache of its own, in step with the target's
    head: bool = False  # loads a trained head: the config's "model" key is required
    tree: bool = False  # drafts trees (DraftBatch.parents) when given one, not only chains
    parallel: bool = False  # drafts all k tokens in one pass (PARD, DFlash)


class SpeculativeConfig(BaseModel):
    """The keys every method accepts (vLLM's names). Each method subclasses it with `method: Literal[name]`
    and its own keys, and the union of those subclasses, discriminated by `method`, is the schema of
    `--speculative-config` (see `draftsmith.serve.speculation.config`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    method: str
    model: str | None = None
    num_speculative_tokens: int | None = Field(default=None, gt=0, le=64)
    draft_tensor_parallel_size: int | None = None
    # vLLM has spelled exactness two ways: strict|probabilistic (early 2026), then standard plus
    # draft_sample_method greedy|probabilistic. Both spellings are accepted and folded into the second.
    rejection_sample_method: Literal["standard", "strict", "probabilistic", "synthetic"] = "standard"
    draft_sample_method: Literal["greedy", "probabilistic"] | None = None
    # Benchmarking only: each draft token is accepted with this probability whatever it is, so the
    # output is NOT the target's distribution. Never serve users with it.
    synthetic_acceptance_rate: float | None = Field(default=None, ge=0.0, le=1.0)
    # draftsmith: each step drafts 0..num_speculative_tokens tokens per request, sized by a measured cost
    # model and the acceptance seen so far; false keeps k fixed
    adaptive: bool = True
    # vLLM's manual schedule, rows [batch_lo, batch_hi, k] (inclusive): k by the number of decoding requests
    # (sizes no row covers use num_speculative_tokens). Setting it replaces the adaptive choice.
    num_speculative_tokens_per_batch_size: list[tuple[int, int, int]] | None = None

    @model_validator(mode="after")
    def _common_checks(self) -> SpeculativeConfig:
        self._check_batch_size_table()
        if self.draft_tensor_parallel_size not in (None, 1):
            raise ValueError(f"draft_tensor_parallel_size={self.draft_tensor_parallel_size}: only 1 is supported")
        if self.num_speculative_tokens is None:
            raise ValueError(f"num_speculative_tokens is required for method {self.method!r}")
        synthetic = self.rejection_sample_method == "synthetic"
        if synthetic != (self.synthetic_acceptance_rate is not None):
            raise ValueError("synthetic_acceptance_rate is required with, and only with, "
                             "rejection_sample_method='synthetic'")
        sampling = self.draft_sample_method
        if self.rejection_sample_method == "probabilistic":
            if sampling == "greedy":
                raise ValueError("rejection_sample_method='probabilistic' means sampled drafts; it contradicts "
                                 "draft_sample_method='greedy'")
            sampling = "probabilistic"
        if self.rejection_sample_method in ("strict", "probabilistic"):
            object.__setattr__(self, "rejection_sample_method", "standard")
        object.__setattr__(self, "draft_sample_method", sampling or "greedy")
        return self


    def _check_batch_size_table(self) -> None:
        table = self.num_speculative_tokens_per_batch_size
        if table is None:
            return
        if "adaptive" in self.model_fields_set and self.adaptive:
            raise ValueError("num_speculative_tokens_per_batch_size fixes k by batch size; it contradicts "
                             "adaptive=true (drop one of them)")
        spans = sorted(table)
        for lo, hi, k in spans:
            if not 1 <= lo <= hi:
                raise ValueError(f"num_speculative_tokens_per_batch_size row [{lo}, {hi}, {k}]: need 1 <= "
                                 "batch_lo <= batch_hi")
            if self.num_speculative_tokens is not None and not 0 <= k <= self.num_speculative_tokens:
                raise ValueError(f"num_speculative_tokens_per_batch_size row [{lo}, {hi}, {k}]: k must be in "
                                 f"[0, num_speculative_tokens={self.num_speculative_tokens}]")
        for (_, hi, _), (next_lo, _, _) in zip(spans, spans[1:]):
            if next_lo <= hi:
                raise ValueError(f"num_speculative_tokens_per_batch_size rows overlap at batch size {next_lo}")
        object.__setattr__(self, "adaptive", False)


def check_tree_verification(config: SpeculativeConfig, key: str, sized: bool = False) -> None:
    """What a config drafting trees (named by `key`) must not ask for: sampled drafts (tree drafts are
    deterministic; sampled requests still sample exactly), synthetic acceptance, k by batch size. `sized`:
    its trees come with confidences the engine sizes them by while adaptive (the default); otherwise they are
    verified whole and adaptive is set false."""
    if config.draft_sample_method == "probabilistic":
        raise ValueError(f"{key} drafts deterministic trees: draft_sample_method must be greedy")
    if config.rejection_sample_method == "synthetic":
        raise ValueError(f"{key} cannot be combined with rejection_sample_method='synthetic'")
    if config.num_speculative_tokens_per_batch_size is not None:
        raise ValueError(f"{key} cannot be combined with num_speculative_tokens_per_batch_size")
    if not sized:
        if "adaptive" in config.model_fields_set and config.adaptive:
            raise ValueError(f"{key} is verified whole every step: it cannot be combined with adaptive=true")
        object.__setattr__(config, "adaptive", False)


class TreeSpeculativeConfig(SpeculativeConfig):
    """The keys of a method that can draft a static tree: vLLM's `speculative_token_tree`
    (`methods.token_tree`), whose nodes are the num_speculative_tokens drafts of every step. A static tree is
    verified whole (its order is not likeliest-first, so no sizing), and its drafts are deterministic (a sampled request still
    samples exactly: `serve.speculation.tree_verify`)."""

    speculative_token_tree: str | None = None

    @model_validator(mode="after")
    def _tree_checks(self) -> TreeSpeculativeConfig:
        if self.speculative_token_tree is None:
            return self
        tree = TokenTree.parse(self.speculative_token_tree)
        if self.num_speculative_tokens != tree.num_nodes:
            raise ValueError(f"speculative_token_tree has {tree.num_nodes} nodes: num_speculative_tokens must equal "
                             f"that, not {self.num_speculative_tokens}")
        check_tree_verification(self, "speculative_token_tree")
        return self

    def token_tree(self) -> TokenTree | None:
        return None if self.speculative_token_tree is None else TokenTree.parse(self.speculative_token_tree)


class RecipeModelSection(BaseModel):
    """The `model:` section of a training recipe; each trainable method subclasses it with
    `head_type: Literal[name]` and its own keys."""

    model_config = ConfigDict(extra="forbid")

    target: str = Field(description="HF directory of the frozen target model")
    head_type: str
    # HF hidden_states indices the head reads; default: the method's `default_feature_layers`
    aux_layer_ids: list[int] | None = None
    intermediate_size: int | None = Field(default=None, gt=0, description="default: the target's")
    init_from: str | None = Field(default=None, description="start from this saved head instead of random")

    @field_validator("aux_layer_ids")
    @classmethod
    def _distinct_layers(cls, ids: list[int] | None) -> list[int] | None:
        repeated = sorted({i for i in ids or () if ids.count(i) > 1})
        if repeated:
            raise ValueError(f"{ids} repeats layer {', '.join(map(str, repeated))}: each fused target layer must be "
                             "distinct (e.g. [1, 3, 5] for a 6-layer target), or leave feature_layers out for the "
                             "method's default")
        return ids


class FinalHiddenRecipe(RecipeModelSection):
    """The `model:` section of heads that read the target's final normed hidden state only (Medusa, MLP
    speculator): there are no fused layers to choose."""

    @field_validator("aux_layer_ids")
    @classmethod
    def _final_hidden_only(cls, ids: list[int] | None) -> None:
        if ids is not None:
            raise ValueError(f"{ids}: these heads read the target's final hidden state only; drop aux_layer_ids")
        return ids

    @field_validator("intermediate_size")
    @classmethod
    def _no_intermediate_size(cls, size: int | None) -> None:
        if size is not None:
            raise ValueError("these heads have no decoder layer to size; drop intermediate_size")
        return size


class RecipeTrainingSection(BaseModel):
    """The `training:` section of a recipe: what every method's training shares. A method with knobs of its
    own (loss weights, unroll depth) subclasses it as its `training_section`."""

    model_config = ConfigDict(extra="forbid")

    output_dir: str
    epochs: int = Field(default=1, gt=0)
    max_steps: int | None = Field(default=None, gt=0, description="optimizer steps; stops early when reached")
    max_minutes: float | None = Field(default=None, gt=0, description="wall-clock budget of the training loop: it "
                                      "stops at the first optimizer step past it, then evaluates and saves (the LR "
                                      "schedule still spans epochs or max_steps)")
    save_dtype: Literal["bfloat16", "float32"] = Field(default="bfloat16", description="floating tensors of the "
                                                       "saved head (public heads ship in bf16)")
    batch_size: int = Field(default=4, gt=0, description="per process")
    gradient_accumulation_steps: int = Field(default=1, gt=0)
    learning_rate: float = Field(default=1e-4, gt=0)
    weight_decay: float = Field(default=0.0, ge=0)
    warmup_ratio: float = Field(default=0.015, ge=0, lt=1)
    max_grad_norm: float = Field(default=0.5, gt=0)
    mixed_precision: Literal["no", "bf16"] = "no"
    eval_max_k: int = Field(default=8, gt=0, description="simulated acceptance reported for k = 1..eval_max_k")
    save_every_steps: int = Field(default=200, gt=0)
    keep_checkpoints: int = Field(default=2, gt=0)
    log_every_steps: int = Field(default=10, gt=0)
    seed: int = 0
    num_workers: int = Field(default=0, ge=0)


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
    # what drafting cost, for the policy's cost model: the sequential draft forwards this propose ran, and
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


class Proposer:
    """Drafts tokens for the rows being decoded; returned by its method's `proposer_class()`.

    The engine's cost model reads about drafting: `sequential` (each further draft token costs one more
    sequential draft forward, as in EAGLE; False when one pass yields them all, as in n-gram lookup or
    parallel drafting), `propose_first` (drafting is so cheap that the engine drafts before it sizes the
    step, so it knows which rows have drafts at all), and what each `propose` returns: its DraftBatch's
    `forwards` and `steady`.
    """

    sequential: ClassVar[bool] = True
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
        # what one draft forward costs, for the planner's first guess: about `draft_cost_guess` (None: the
        # planner's default for a one-layer head) times the target's forward of `draft_query_len` tokens a row
        self.draft_query_len = 1
        self.draft_cost_guess: float | None = None
        # set where it drafts trees (DraftBatch.parents): the planner's chain width does not cap their nodes
        self.tree = None
        # runs the one-token draft steps at static shapes (`serve.engine.step_graphs.DraftStepRunner`), set by the
        # engine when its step mode is not eager and `static_step_head` names a head
        self.draft_steps = None

    def static_step_head(self):
        """(head, its KV cache) when drafting runs that head one token a row at a time after a first forward
        (EAGLE drafts 2..k), so those steps can run at static shapes; None otherwise."""
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
        any of them has). The planner prices that catch-up."""
        return 0, 0

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

    def release(self, request: RowState) -> None:
        """The request finished or was aborted: drop whatever was kept for it."""

    def metrics(self) -> dict:
        """Numbers of its own for the engine's metrics (a cache's size), if any."""
        return {}

    def forget(self) -> None:
        """Drops what it learned from earlier requests (a benchmark's rounds then start alike)."""


class SpecMethod:
    """A speculation method: subclass, set the class attributes, register with `@register_method`."""

    name: ClassVar[str] = ""
    section: ClassVar[type[SpeculativeConfig]]  # its --speculative-config section, `method: Literal[name]`
    needs: ClassVar[MethodNeeds] = MethodNeeds()
    head_type: ClassVar[str | None] = None  # the native head format it serves/trains, if any
    recipe_section: ClassVar[type[RecipeModelSection] | None] = None  # set when the method trains a head
    training_section: ClassVar[type[RecipeTrainingSection]] = RecipeTrainingSection
    head_config: ClassVar[type | None] = None  # the `HeadConfig` subclass of its native head format
    # the `nn.Module` that runs its head (training and serving); None while the head only converts
    head_module: ClassVar[type | None] = None
    # modules that register its `draftsmith convert` formats and exporters, imported by `load_formats` only
    converters: ClassVar[tuple[str, ...]] = ()
    # The parts each layer loads only when asked, as "module:name"; a module starting with "." is in the
    # package of the class that declares the reference (a method's folder). None: the method has no such part.
    proposer_ref: ClassVar[str | None] = None  # the engine's Proposer subclass
    objective_ref: ClassVar[str | None] = None  # the trainer's objective
    acceptance_eval_ref: ClassVar[str | None] = None  # the trainer's simulated acceptance

    @classmethod
    def proposer_class(cls) -> type[Proposer] | None:
        """The proposer the engine builds, or None when the method cannot be served (yet)."""
        return cls._resolve("proposer_ref")

    @classmethod
    def objective(cls) -> Callable[..., Any] | None:
        """`objective(head, target, batch, features, training_cfg) -> (loss, logs)`, or None if untrainable."""
        return cls._resolve("objective_ref")

    @classmethod
    def acceptance_eval(cls) -> Callable[..., Any] | None:
        """`evaluate(head, target, batch, features, max_k) -> (accepted chains per depth [max_k], chain
        starts)`, optionally followed by (tokens, blocks) of the batch drafted block after block as a server
        drafts it: the trainer's per-epoch simulated acceptance, or None to skip it."""
        return cls._resolve("acceptance_eval_ref")

    @classmethod
    def _resolve(cls, attribute: str):
        """The object a `*_ref` names, imported now; a relative module is resolved as a relative import in the
        module of the class that set the reference would be (a subclass elsewhere inherits what it meant)."""
        ref = getattr(cls, attribute)
        if ref is None:
            return None
        owner = next(k for k in cls.__mro__ if attribute in vars(k))
        module, _, name = ref.partition(":")
        return getattr(importlib.import_module(module, sys.modules[owner.__module__].__package__), name)

    @classmethod
    def build_head(cls, section: RecipeModelSection, target, feature_layers: tuple[int, ...], token_records):
        """A freshly initialized head for `target` (the trainer's starting point). `token_records` iterates the
        training records ({"input_ids", "loss_mask"}) for methods that choose something from the data."""
        raise DraftsmithError(f"method {cls.name!r} does not train a head")

    @classmethod
    def record_training(cls, head, training: RecipeTrainingSection) -> None:
        """Notes on `head`, before training, what its saved checkpoint must know of how it was trained (PARD:
        how many tokens one forward learned to draft). Most heads carry all of it in their architecture."""

    @classmethod
    def default_feature_layers(cls, num_layers: int) -> tuple[int, ...]:
        """HF hidden_states indices its head reads from a `num_layers` target, when a recipe names none."""
        raise DraftsmithError(f"method {cls.name!r} reads no target layers")


class FinalHiddenMethod(SpecMethod):
    """What methods whose head reads only the target's final normed hidden state share (Medusa, MLP
    speculator): their needs and the one layer they read."""

    needs: ClassVar[MethodNeeds] = MethodNeeds(hidden_states=True, head=True, draft_probs=True)

    @classmethod
    def default_feature_layers(cls, num_layers: int) -> tuple[int, ...]:
        return (num_layers,)  # HF hidden_states[L]: after the final norm, what the target's LM head reads

