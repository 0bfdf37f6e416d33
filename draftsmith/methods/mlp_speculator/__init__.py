"""IBM/fms MLP speculator: n_predict MLP stages over the target's last hidden state. Converts
(`draftsmith convert`) to and from the native format, trains by distillation from the frozen target, and
serves (greedy drafts)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from draftsmith.methods.base import FinalHiddenMethod
from draftsmith.methods.mlp_speculator.head import MLPSpeculatorHead
from draftsmith.methods.recipe_sections import FinalHiddenRecipe, RecipeTrainingSection
from draftsmith.methods.registry import register_method
from draftsmith.methods.speculative_config import SpeculativeConfig
from draftsmith.models.head_configs import MLPSpeculatorConfig


class MLPSpeculatorSpecConfig(SpeculativeConfig):
    method: Literal["mlp_speculator"]


class MLPSpeculatorRecipe(FinalHiddenRecipe):
    head_type: Literal["mlp_speculator"]
    n_predict: int = Field(default=3, gt=0, description="stages, one draft each: the most num_speculative_tokens")
    inner_dim: int | None = Field(default=None, gt=0, description="the stages' width; default: the target's hidden")
    tie_weights: bool = Field(default=False, description="every stage shares stage 0's embedding, norm and head, "
                              "and stages 2 on stage 1's projection")
    scale_input: bool = Field(default=False, description="norm the target's hidden state (no weights) and / sqrt 2")


class MLPSpeculatorTraining(RecipeTrainingSection):
    stage_decay: float = Field(default=0.8, gt=0, description="loss weight of stage i is decay**i")
    labels: Literal["target", "text"] = Field(default="target", description="IBM's two stages: 'text' learns the "
                                              "text's own next tokens (stage 1, plain text), 'target' the "
                                              "target's distribution (stage 2, its own generations)")


@register_method
class MLPSpeculatorMethod(FinalHiddenMethod):
    name = "mlp_speculator"
    section = MLPSpeculatorSpecConfig
    head_type = "mlp_speculator"
    head_config = MLPSpeculatorConfig
    head_module = MLPSpeculatorHead
    recipe_section = MLPSpeculatorRecipe
    training_section = MLPSpeculatorTraining
    converters = (".convert",)
    proposer_ref = ".proposer:MLPSpeculatorProposer"
    objective_ref = ".objective:mlp_speculator_objective"
    acceptance_eval_ref = ".objective:simulated_acceptance"

    @classmethod
    def build_head(cls, section: MLPSpeculatorRecipe, target, feature_layers, token_records):
        c = target.config
        config = MLPSpeculatorConfig(emb_dim=c.hidden_size, inner_dim=section.inner_dim or c.hidden_size,
                                     vocab_size=c.vocab_size, n_predict=section.n_predict,
                                     tie_weights=section.tie_weights, scale_input=section.scale_input,
                                     target_model=section.target)
        head = MLPSpeculatorHead(config).attach_target(target)
        head.init_from_target()
        return head

