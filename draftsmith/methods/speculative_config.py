"""`--speculative-config`: the keys every method shares (vLLM's names), and those of methods that draft
trees. A method's own section subclasses one of these (pydantic, extra="forbid")."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from draftsmith.methods.token_tree import TokenTree


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
    # vLLM's: a decode step of more than this many requests runs without speculation (adaptive or not); vLLM
    # asks for at least 2
    disable_by_batch_size: int | None = Field(default=None, ge=2)

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
