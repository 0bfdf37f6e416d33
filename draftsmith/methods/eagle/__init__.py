"""EAGLE-1/2: a one-layer head over [embedding of token t+1; the target's final hidden state at t] that
predicts the next feature, read out by the target's own LM head. Trained by feature regression plus
soft cross-entropy; served by drafting autoregressively from its own outputs (see `proposer.py`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from draftsmith.methods.base import (
    MethodNeeds,
    RecipeModelSection,
    RecipeTrainingSection,
    SpecMethod,
    SpeculativeConfig,
)
from draftsmith.methods.registry import register_method
from draftsmith.models.eagle import EagleHead
from draftsmith.models.heads import DraftHeadConfig

EAGLE_FAMILY_NEEDS = MethodNeeds(hidden_states=True, draft_probs=True, own_kv_cache=True, head=True)


class HeadSpeculativeConfig(SpeculativeConfig):
    """Keys of the methods that draft with a trained head."""

    # draftsmith: the head's dtype. Drafts are only proposals, so this never changes what is generated, only
    # how often drafts are accepted and how fast they come: a bfloat16 head reads half the bytes per draft
    # step of a float32 one. "auto": the target's, but bfloat16 under a float32 target where the device has
    # fast bfloat16 matmuls (`draftsmith.methods.heads.draft_dtype`).
    draft_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"


class EagleConfig(HeadSpeculativeConfig):
    method: Literal["eagle"]


class EagleRecipe(RecipeModelSection):
    head_type: Literal["eagle"]


class EagleTraining(RecipeTrainingSection):
    noise_std: float = Field(default=0.2, ge=0, description="uniform noise on the input features")
    feature_loss_weight: float = Field(default=1.0, ge=0)
    token_loss_weight: float = Field(default=0.1, ge=0)


class EagleFamilyMethod(SpecMethod):
    """What EAGLE and EAGLE-3 share: a `DraftHeadConfig` head attached to its target."""

    needs = EAGLE_FAMILY_NEEDS
    head_config = DraftHeadConfig

    @classmethod
    def proposer_class(cls):
        from draftsmith.methods.eagle.proposer import EagleFamilyProposer

        return EagleFamilyProposer

    @classmethod
    def acceptance_eval(cls):
        from draftsmith.methods.eagle.training import simulated_acceptance

        return simulated_acceptance

    @classmethod
    def head_config_overrides(cls, section: RecipeModelSection) -> dict:
        """Recipe keys of its own that shape the head config (EAGLE-3: the draft vocabulary size)."""
        return {}

    @classmethod
    def build_head(cls, section: RecipeModelSection, target, aux_layer_ids: tuple[int, ...], token_records):
        overrides = {"intermediate_size": section.intermediate_size} if section.intermediate_size else {}
        config = DraftHeadConfig.for_target(cls.head_type, target.config, aux_layer_ids, target_model=section.target,
                                            **cls.head_config_overrides(section), **overrides)
        config.check_target(target.config)
        return cls.head_module(config).attach_target(target)


@register_method
class EagleMethod(EagleFamilyMethod):
    name = "eagle"
    section = EagleConfig
    recipe_section = EagleRecipe
    training_section = EagleTraining
    head_type = "eagle"
    head_module = EagleHead
    converters = ("draftsmith.convert.eagle", "draftsmith.convert.speculators")

    @classmethod
    def objective(cls):
        from draftsmith.methods.eagle.objective import eagle_objective

        return eagle_objective

    @classmethod
    def default_aux_layers(cls, num_layers: int) -> tuple[int, ...]:
        return (num_layers,)  # the final normed hidden state, which the target's LM head reads
