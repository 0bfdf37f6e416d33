"""Medusa-1: parallel ResBlock heads over the target's final normed hidden state, head i drafting token
t + 2 + i. Converts (`draftsmith convert`) to and from the native format, trains by distillation from the
frozen target, and serves a top-1 chain or a static candidate tree (`speculative_token_tree`: the node
at path (r1, r2, ...) is head 1's rank-r1 token, then head 2's rank-r2 token, ...)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from draftsmith.methods.base import FinalHiddenMethod, MethodNeeds
from draftsmith.methods.medusa.head import MedusaHead
from draftsmith.methods.recipe_sections import FinalHiddenRecipe, RecipeTrainingSection
from draftsmith.methods.registry import register_method
from draftsmith.methods.speculative_config import TreeSpeculativeConfig
from draftsmith.models.head_configs import MedusaConfig


class MedusaSpecConfig(TreeSpeculativeConfig):
    method: Literal["medusa"]


class MedusaRecipe(FinalHiddenRecipe):
    head_type: Literal["medusa"]
    num_heads: int = Field(default=3, gt=0, description="heads, one draft each: the most num_speculative_tokens")
    num_layers: int = Field(default=1, gt=0, description="ResBlocks per head")
    own_lm_heads: bool = Field(default=True, description="false: every head reads out through the target's LM "
                               "head (Medusa-2 style, far fewer parameters)")


class MedusaTraining(RecipeTrainingSection):
    head_decay: float = Field(default=0.8, gt=0, description="loss weight of head i is decay**i (Medusa's 0.8)")


@register_method
class MedusaMethod(FinalHiddenMethod):
    name = "medusa"
    needs = MethodNeeds(hidden_states=True, head=True, draft_probs=True, tree=True)
    section = MedusaSpecConfig
    head_type = "medusa"
    head_config = MedusaConfig
    head_module = MedusaHead
    recipe_section = MedusaRecipe
    training_section = MedusaTraining
    converters = (".convert",)
    proposer_ref = ".proposer:MedusaProposer"
    objective_ref = ".objective:medusa_objective"
    acceptance_eval_ref = ".objective:simulated_acceptance"

    @classmethod
    def build_head(cls, section: MedusaRecipe, target, feature_layers, token_records):
        c = target.config
        config = MedusaConfig(hidden_size=c.hidden_size, vocab_size=c.vocab_size, num_heads=section.num_heads,
                              num_layers=section.num_layers, own_lm_heads=section.own_lm_heads,
                              target_model=section.target)
        head = MedusaHead(config).attach_target(target)
        head.init_from_target()
        return head

