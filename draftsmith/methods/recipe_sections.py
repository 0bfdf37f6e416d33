"""The recipe sections every trainable method shares: its `model:` section (target, head type, the target
layers it reads) and its `training:` section. A method's own sections subclass these."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class RecipeModelSection(BaseModel):
    """The `model:` section of a training recipe; each trainable method subclasses it with
    `head_type: Literal[name]` and its own keys."""

    model_config = ConfigDict(extra="forbid")

    target: str = Field(description="HF directory of the frozen target model")
    head_type: str
    # HF hidden_states indices the head reads; default: the method's `default_feature_layers`
    aux_layer_ids: list[int] | None = None
    intermediate_size: int | None = Field(default=None, gt=0, description="default: the target's")
    init_from: str | None = Field(default=None, description="start from this saved head instead of random")
    # recipe keys whose head-config field has another name (recipe key -> config field)
    CONFIG_NAMES: ClassVar[dict[str, str]] = {}
    # recipe keys that only say how new weights start: a saved head (init_from) has no field to match them
    START_ONLY: ClassVar[frozenset[str]] = frozenset()

    @field_validator("aux_layer_ids")
    @classmethod
    def _distinct_layers(cls, ids: list[int] | None) -> list[int] | None:
        repeated = sorted({i for i in ids or () if ids.count(i) > 1})
        if repeated:
            raise ValueError(f"{ids} repeats layer {', '.join(map(str, repeated))}: each fused target layer must be "
                             "distinct (e.g. [1, 3, 5] for a 6-layer target), or leave feature_layers out for the "
                             "method's default")
        return ids


class FinalHiddenRecipe(RecipeModelSection):
    """The `model:` section of heads that read the target's final normed hidden state only (Medusa, MLP
    speculator): there are no fused layers to choose."""

    @field_validator("aux_layer_ids")
    @classmethod
    def _final_hidden_only(cls, ids: list[int] | None) -> None:
        if ids is not None:
            raise ValueError(f"{ids}: these heads read the target's final hidden state only; drop aux_layer_ids")
        return ids

    @field_validator("intermediate_size")
    @classmethod
    def _no_intermediate_size(cls, size: int | None) -> None:
        if size is not None:
            raise ValueError("these heads have no decoder layer to size; drop intermediate_size")
        return size


class RecipeTrainingSection(BaseModel):
    """The `training:` section of a recipe: what every method's training shares. A method with knobs of its
    own (loss weights, unroll depth) subclasses it as its `training_section`."""

    model_config = ConfigDict(extra="forbid")

    output_dir: str
    epochs: int = Field(default=1, gt=0)
    max_steps: int | None = Field(default=None, gt=0, description="optimizer steps; stops early when reached")
    max_minutes: float | None = Field(default=None, gt=0, description="wall-clock budget of the training loop: it "
                                      "stops at the first optimizer step past it, then evaluates and saves; the LR "
                                      "cosine ends with it where it ends the run before epochs or max_steps")
    save_dtype: Literal["bfloat16", "float32"] = Field(default="bfloat16", description="floating tensors of the "
                                                       "saved head (public heads ship in bf16)")
    batch_size: int = Field(default=4, gt=0, description="per process")
    gradient_accumulation_steps: int = Field(default=1, gt=0)
    learning_rate: float = Field(default=1e-4, gt=0)
    weight_decay: float = Field(default=0.0, ge=0)
    warmup_ratio: float = Field(default=0.015, ge=0, lt=1)
    max_grad_norm: float = Field(default=0.5, gt=0)
    mixed_precision: Literal["no", "bf16"] = "no"
    eval_max_k: int = Field(default=8, gt=0, description="simulated acceptance reported for k = 1..eval_max_k")
    save_every_steps: int = Field(default=200, gt=0)
    keep_checkpoints: int = Field(default=2, gt=0)
    log_every_steps: int = Field(default=10, gt=0)
    seed: int = 0
    num_workers: int = Field(default=0, ge=0)
