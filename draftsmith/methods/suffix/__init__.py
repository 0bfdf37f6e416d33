"""Suffix decoding (Arctic Inference; arXiv 2411.04975): drafts the most frequent continuation of the newest
tokens, found in suffix trees over this request's prompt and output and over earlier requests' outputs.
Needs no head and no training; deterministic, so its drafts are greedy (one-hot q). vLLM's keys."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from draftsmith.methods.base import MethodNeeds, SpecMethod
from draftsmith.methods.registry import register_method
from draftsmith.methods.speculative_config import SpeculativeConfig


class SuffixConfig(SpeculativeConfig):
    method: Literal["suffix"]
    suffix_decoding_max_tree_depth: int = Field(default=24, ge=1, le=64,
                                                description="longest context matched and continuation kept")
    suffix_decoding_max_cached_requests: int = Field(default=10000, ge=0, description="finished requests whose "
                                                     "outputs the global tree keeps (oldest evicted first); 0: none")
    suffix_decoding_max_spec_factor: float = Field(default=1.0, gt=0, description="drafts at most this times "
                                                   "the matched length")
    suffix_decoding_min_token_prob: float = Field(default=0.1, ge=0, le=1, description="drafting stops where the "
                                                  "continuation's estimated probability falls below this")
    # draftsmith: the global tree's memory bound (its trie keeps up to max_tree_depth nodes per varied output
    # token, where Arctic's compressed tree keeps about one): the oldest outputs go first past it
    suffix_decoding_max_cache_mb: float = Field(default=1024.0, gt=0, description="the global tree's memory "
                                                "bound in MiB; the oldest cached outputs are evicted past it")

    @model_validator(mode="before")
    @classmethod
    def _default_k(cls, data: Any) -> Any:
        """As vLLM: without num_speculative_tokens, the tree depth is the cap."""
        if isinstance(data, dict) and data.get("num_speculative_tokens") is None:
            data = {**data, "num_speculative_tokens": data.get("suffix_decoding_max_tree_depth", 24)}
        return data


@register_method
class SuffixMethod(SpecMethod):
    name = "suffix"
    section = SuffixConfig
    needs = MethodNeeds()
    proposer_ref = ".proposer:SuffixProposer"

