"""Draft models: an independent small LM with the target's tokenizer drafts k tokens autoregressively from its
own KV cache, kept in step with what the target accepts. Needs no training (any model of a family the
runtime runs); with `draft_sample_method: probabilistic` it samples its drafts from its own distribution."""

from __future__ import annotations

from typing import Literal

from pydantic import model_validator

from draftsmith.methods.base import MethodNeeds, SpecMethod
from draftsmith.methods.eagle import HeadSpeculativeConfig
from draftsmith.methods.registry import register_method


class DraftModelConfig(HeadSpeculativeConfig):
    method: Literal["draft_model"]
    # vLLM's key for PARD (one forward drafts all k from mask tokens)
    parallel_drafting: bool = False

    @model_validator(mode="after")
    def _no_parallel_yet(self) -> DraftModelConfig:
        if self.parallel_drafting:
            raise ValueError("parallel_drafting (PARD) is not available yet; drop it to draft token by token")
        return self


@register_method
class DraftModelMethod(SpecMethod):
    name = "draft_model"
    section = DraftModelConfig
    # "model" required (a model directory, not a head); drafts sampled with a real q; a KV cache of its own
    needs = MethodNeeds(head=True, draft_probs=True, own_kv_cache=True)

    @classmethod
    def proposer_class(cls):
        from draftsmith.methods.draft_model.proposer import DraftModelProposer

        return DraftModelProposer
