"""Multi-token prediction (DeepSeek-V3 style): one MTP layer over [embedding of token t+1; the target's final
hidden state at t], applied recursively for k drafts. Serves the MTP layers a target ships (converted by
`draftsmith convert`, where the block is one the runtime runs) and trains one for a target that has none,
distilled from the frozen target over `ttt_length` recursive steps with FastMTP's step weights."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator

from draftsmith.methods.base import SpecMethod
from draftsmith.methods.eagle import EAGLE_FAMILY_NEEDS, HeadSpeculativeConfig
from draftsmith.methods.mtp.head import MTPHead
from draftsmith.methods.recipe_sections import FinalHiddenRecipe, RecipeTrainingSection
from draftsmith.methods.registry import register_method
from draftsmith.models.head_configs import MTPConfig


class MTPSpecConfig(HeadSpeculativeConfig):
    method: Literal["mtp"]


class MTPRecipe(FinalHiddenRecipe):
    head_type: Literal["mtp"]

    @field_validator("intermediate_size")
    @classmethod
    def _no_intermediate_size(cls, size: int | None) -> None:  # overrides FinalHiddenRecipe's message
        if size is not None:
            raise ValueError("an MTP layer is shaped like a layer of the target (it starts as a copy of the last "
                             "one); drop intermediate_size")
        return size


class MTPTraining(RecipeTrainingSection):
    ttt_length: int = Field(default=3, gt=0, description="recursive steps unrolled per batch (FastMTP: 3)")
    step_decay: float = Field(default=0.6, gt=0, description="step s weighs decay**s, normalized to sum 1 "
                              "(FastMTP's beta)")


@register_method
class MTPMethod(SpecMethod):
    name = "mtp"
    section = MTPSpecConfig
    needs = EAGLE_FAMILY_NEEDS  # drafts like an EAGLE head: recursively, with a cache of its own
    head_type = "mtp"
    head_config = MTPConfig
    head_module = MTPHead
    recipe_section = MTPRecipe
    training_section = MTPTraining
    converters = (".convert",)
    proposer_ref = "draftsmith.methods.eagle.proposer:EagleFamilyProposer"
    objective_ref = ".objective:mtp_objective"
    acceptance_eval_ref = "draftsmith.methods.eagle.training:simulated_acceptance"

    @classmethod
    def default_feature_layers(cls, num_layers: int) -> tuple[int, ...]:
        return (num_layers,)  # HF hidden_states[L]: after the final norm, what vLLM's MTP models receive

    @classmethod
    def build_head(cls, section: MTPRecipe, target, feature_layers, token_records):
        source_config = json.loads((Path(section.target) / "config.json").read_text())
        head = MTPHead.for_target(target.config, source_config, target_model=section.target).attach_target(target)
        head.init_from_target()
        return head
