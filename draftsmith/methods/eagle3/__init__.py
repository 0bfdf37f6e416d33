"""EAGLE-3: a one-layer head fusing three target layers, with its own LM head over a draft vocabulary
chosen by token frequency, trained with training-time test (its own outputs fed back for several steps)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from draftsmith.methods.base import RecipeModelSection, RecipeTrainingSection
from draftsmith.methods.eagle import EagleFamilyMethod, HeadSpeculativeConfig
from draftsmith.methods.registry import register_method
from draftsmith.models.eagle3 import Eagle3Head


class Eagle3Config(HeadSpeculativeConfig):
    method: Literal["eagle3"]


class Eagle3Recipe(RecipeModelSection):
    head_type: Literal["eagle3"]
    draft_vocab_size: int | None = Field(default=None, gt=0, description="default: the target's vocab")


class Eagle3Training(RecipeTrainingSection):
    ttt_length: int = Field(default=7, gt=0, description="training-time-test steps unrolled per batch")
    ttt_step_decay: float = Field(default=0.8, gt=0, description="loss weight of step s is decay**s")


@register_method
class Eagle3Method(EagleFamilyMethod):
    name = "eagle3"
    section = Eagle3Config
    recipe_section = Eagle3Recipe
    training_section = Eagle3Training
    head_type = "eagle3"
    head_module = Eagle3Head
    converters = ("draftsmith.convert.eagle3", "draftsmith.convert.speculators")

    @classmethod
    def objective(cls):
        from draftsmith.methods.eagle3.objective import eagle3_objective

        return eagle3_objective

    @classmethod
    def default_aux_layers(cls, num_layers: int) -> tuple[int, ...]:
        return (2, num_layers // 2, num_layers - 3)  # the EAGLE-3 reference choice, HF hidden_states indexing

    @classmethod
    def head_config_overrides(cls, section: Eagle3Recipe) -> dict:
        return {"draft_vocab_size": section.draft_vocab_size} if section.draft_vocab_size else {}

    @classmethod
    def build_head(cls, section, target, aux_layer_ids, token_records):
        from draftsmith.methods.eagle3.vocab import draft_vocab_from_frequencies

        head = super().build_head(section, target, aux_layer_ids, token_records)
        c = head.config
        head.init_draft_vocab(draft_vocab_from_frequencies(token_records, c.vocab_size, c.draft_vocab_size))
        return head
