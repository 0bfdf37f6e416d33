"""EAGLE-1/2: a one-layer head over [embedding of token t+1; the target's final hidden state at t] that
predicts the next feature, read out by the target's own LM head. Trained by feature regression plus
soft cross-entropy; served by drafting autoregressively from its own outputs (see `proposer.py`)."""

from __future__ import annotations

from dataclasses import replace
from typing import Literal

from pydantic import Field, model_validator

from draftsmith.methods.base import MethodNeeds, SpecMethod
from draftsmith.methods.eagle.head import EagleHead
from draftsmith.methods.recipe_sections import RecipeModelSection, RecipeTrainingSection
from draftsmith.methods.registry import register_method
from draftsmith.methods.speculative_config import (
    SpeculativeConfig,
    TreeSpeculativeConfig,
    check_tree_verification,
)
from draftsmith.models.heads import DraftHeadConfig

EAGLE_FAMILY_NEEDS = MethodNeeds(hidden_states=True, draft_probs=True, own_kv_cache=True, head=True)


class HeadSpeculativeConfig(SpeculativeConfig):
    """Keys of the methods that draft with a trained head."""

    # draftsmith: the head's dtype. Drafts are only proposals, so this never changes what is generated, only
    # how often drafts are accepted and how fast they come: a bfloat16 head reads half the bytes per draft
    # step of a float32 one. "auto": the target's, but bfloat16 under a float32 target where the device has
    # fast bfloat16 matmuls (`draftsmith.methods.heads.draft_dtype`).
    draft_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"


class EagleTreeConfig(HeadSpeculativeConfig, TreeSpeculativeConfig):
    """A static tree as vLLM spells it (`speculative_token_tree`, verified whole), or EAGLE-2's dynamic draft
    tree (`methods.eagle.tree_drafting`), draftsmith's keys: `tree_depth` tokens
    deep, each depth expanding the `tree_top_k` likeliest nodes (by cumulative draft probability) into their
    top-k children; of the num_speculative_tokens likeliest nodes of all, the engine verifies as one tree
    the w likeliest, w sized each step by the cost model (`adaptive`, the default; false: all of them).
    Without these keys the head drafts a chain."""

    tree_depth: int | None = Field(default=None, ge=1, le=16)
    tree_top_k: int | None = Field(default=None, ge=1, le=16)

    @model_validator(mode="after")
    def _dynamic_tree_checks(self) -> EagleTreeConfig:
        if (self.tree_depth is None) != (self.tree_top_k is None):
            raise ValueError("tree_depth and tree_top_k go together: set both for a draft tree, or neither")
        if self.tree_depth is None:
            return self
        if self.speculative_token_tree is not None:
            raise ValueError("speculative_token_tree (a static tree) and tree_depth/tree_top_k (a dynamic one) "
                             "exclude each other")
        depth, top_k = self.tree_depth, self.tree_top_k
        most = top_k + (depth - 1) * top_k * top_k
        if self.num_speculative_tokens > most:
            raise ValueError(f"a tree {depth} deep expanding {top_k} nodes per depth has {most} candidates: "
                             f"num_speculative_tokens={self.num_speculative_tokens} is more")
        check_tree_verification(self, "tree_depth/tree_top_k", sized=True)
        return self


class EagleConfig(EagleTreeConfig):
    method: Literal["eagle"]


class EagleRecipe(RecipeModelSection):
    head_type: Literal["eagle"]
    sliding_window: int | None = Field(default=None, gt=0, description=(
        "draft attention window, in positions: the head trains, serves and exports (vLLM's layer_types) attending "
        "over the newest this many"))
    fc_bias: bool | None = Field(default=None, description=(
        "a bias on fc (default: true, as yuhuili's EAGLE trains it); vLLM's EAGLE fc has none and serves a head "
        "without it, so a head for vLLM trains with false"))


class EagleTraining(RecipeTrainingSection):
    noise_std: float = Field(default=0.2, ge=0, description="uniform noise on the input features")
    feature_loss_weight: float = Field(default=1.0, ge=0)
    token_loss_weight: float = Field(default=0.1, ge=0)


class EagleFamilyMethod(SpecMethod):
    """What EAGLE and EAGLE-3 share: a `DraftHeadConfig` head attached to its target."""

    needs = replace(EAGLE_FAMILY_NEEDS, tree=True)  # static and EAGLE-2's dynamic trees
    head_config = DraftHeadConfig
    proposer_ref = ".proposer:EagleFamilyProposer"
    acceptance_eval_ref = ".training:simulated_acceptance"

    @classmethod
    def head_config_overrides(cls, section: RecipeModelSection) -> dict:
        """Recipe keys of its own that shape the head config (EAGLE-3: the draft vocabulary size)."""
        return {}

    @classmethod
    def build_head(cls, section: RecipeModelSection, target, feature_layers: tuple[int, ...], token_records):
        overrides = {"intermediate_size": section.intermediate_size} if section.intermediate_size else {}
        config = DraftHeadConfig.for_target(cls.head_type, target.config, feature_layers, target_model=section.target,
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
    converters = (".convert", "draftsmith.methods.formats.speculators")
    objective_ref = ".objective:eagle_objective"

    @classmethod
    def head_config_overrides(cls, section: EagleRecipe) -> dict:
        return {"sliding_window": section.sliding_window, "fc_bias": section.fc_bias}

    @classmethod
    def continue_head(cls, head, section: EagleRecipe, target):
        """`init_from` a saved head: a `sliding_window` the recipe names replaces the saved head's (the weights
        do not depend on it); left out, the saved head's holds."""
        window = section.sliding_window
        if "sliding_window" not in section.model_fields_set or window == head.config.sliding_window:
            return head
        windowed = type(head)(replace(head.config, sliding_window=window))
        windowed.load_state_dict(head.state_dict())
        return windowed

    @classmethod
    def default_feature_layers(cls, num_layers: int) -> tuple[int, ...]:
        return (num_layers,)  # the final normed hidden state, which the target's LM head reads
