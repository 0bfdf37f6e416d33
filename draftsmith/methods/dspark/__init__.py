"""DSpark: DFlash's block drafter, anchor-first, with a low-rank Markov head (each draft also conditions on the
one before it) and a confidence head (the chance each draft is accepted given the ones before), whose running
product sizes each row's verify (`enable_adaptive_verification`, vLLM's key). Head: `head.py`; training:
`objective.py` (DeepSpec's loss); serving: `proposer.py`; formats: `convert.py`."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from draftsmith.methods.base import MethodNeeds
from draftsmith.methods.dflash import DFlashMethod, DFlashRecipe, DFlashTraining
from draftsmith.methods.dspark.head import DSparkConfig, DSparkHead
from draftsmith.methods.eagle import HeadSpeculativeConfig
from draftsmith.methods.registry import register_method


class DSparkSpecConfig(HeadSpeculativeConfig):
    """A chain of up to num_speculative_tokens drafts (at most the head's block_size) from one block forward,
    the Markov term applied along it. With `enable_adaptive_verification` (vLLM's key; draftsmith's default
    true) each row verifies only the prefix of its drafts that pays: the engine takes, over all rows, the drafts
    likeliest to survive (running products of the confidence head's chances) while the expected tokens per
    second of the step still grow under the cost model."""

    method: Literal["dspark"]
    enable_adaptive_verification: bool = True


class DSparkRecipe(DFlashRecipe):
    head_type: Literal["dspark"]
    block_size: int = Field(default=7, ge=2, le=64, description="anchor + masks: block_size drafts a step")
    sample_from_anchor: Literal[True] = Field(default=True, description="DSpark is anchor-first")
    markov_rank: int = Field(default=256, ge=0, description="rank of the Markov head's bigram term (0: none)")
    markov_head_type: Literal["vanilla", "gated"] = Field(default="vanilla", description=(
        "DeepSpec's Markov heads: vanilla, a rank-r bigram term (what vLLM serves); gated, that term scaled per "
        "rank component by the block position's hidden state"))
    enable_confidence_head: bool = True
    confidence_head_with_markov: bool = Field(default=True, description="the confidence head also reads the "
                                              "Markov embedding of the token before each position")


class DSparkTraining(DFlashTraining):
    ce_weight: float = Field(default=0.1, ge=0, description="cross-entropy against the target's greedy token")
    tv_weight: float = Field(default=0.9, ge=0, description="L1 distance of the draft's and the target's "
                             "distributions (twice their total variation), DeepSpec's")
    kd_weight: float = Field(default=0.0, ge=0, description="cross-entropy against the target's whole "
                             "distribution (DFlash's distillation loss; draftsmith's addition, off in DeepSpec's)")
    confidence_weight: float = Field(default=1.0, ge=0, description="BCE of the confidence head")
    confidence_label: Literal["match", "tv"] = Field(default="match", description=(
        "what the confidence head learns: match, whether the draft is the target's greedy token (what greedy "
        "verification accepts); tv, 1 - TV of the two distributions (DeepSpec's: what sampling at T=1 accepts)"))

    @model_validator(mode="after")
    def _some_distillation(self):
        if not (self.ce_weight or self.tv_weight or self.kd_weight):
            raise ValueError("ce_weight, tv_weight and kd_weight are all 0: the drafts would learn nothing")
        return self


@register_method
class DSparkMethod(DFlashMethod):
    name = "dspark"
    section = DSparkSpecConfig
    needs = MethodNeeds(hidden_states=True, draft_probs=True, own_kv_cache=True, head=True, parallel=True)
    head_type = "dspark"
    head_config = DSparkConfig
    head_module = DSparkHead
    recipe_section = DSparkRecipe
    training_section = DSparkTraining
    converters = (".convert",)
    proposer_ref = ".proposer:DSparkProposer"
    objective_ref = ".objective:dspark_objective"
    acceptance_eval_ref = ".objective:simulated_acceptance"

    @classmethod
    def head_fields(cls, section: DSparkRecipe) -> dict:
        return {"markov_rank": section.markov_rank, "markov_head_type": section.markov_head_type,
                "enable_confidence_head": section.enable_confidence_head,
                "confidence_head_with_markov": section.confidence_head_with_markov and section.markov_rank > 0}
