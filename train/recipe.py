"""Training recipes: YAML validated by pydantic (`extra="forbid"`), with `section.key=value` overrides.

The `model:` section belongs to the method that trains the head (`model.head_type`): each trainable
method declares its own section, so method-specific keys (EAGLE-3's `draft_vocab_size`) are valid exactly
where they apply."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, SerializeAsAny, ValidationError, create_model

from draftsmith.errors import DraftsmithError, format_validation_error
from draftsmith.methods import METHODS, RecipeModelSection, trainable
from draftsmith.methods.registry import registry_version, unknown_method_message


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class DataSection(_Section):
    train_files: list[str] = Field(min_length=1, description="JSONL (optionally .xz/.gz): chat or text records")
    eval_files: list[str] | None = None
    format: Literal["auto", "chat", "text"] = "auto"
    max_length: int = Field(default=2048, gt=1)
    max_train_samples: int | None = Field(default=None, gt=0)
    max_eval_samples: int | None = Field(default=200, gt=0)
    eval_fraction: float = Field(default=0.02, ge=0, lt=1, description="held back when eval_files is unset")
    hidden_states_dir: str | None = Field(default=None, description="offline mode: read `draftsmith capture` output")
    hidden_states_dtype: Literal["bfloat16", "float32"] = "bfloat16"


class TrainingSection(_Section):
    output_dir: str
    epochs: int = Field(default=1, gt=0)
    max_steps: int | None = Field(default=None, gt=0, description="optimizer steps; stops early when reached")
    batch_size: int = Field(default=4, gt=0, description="per process")
    gradient_accumulation_steps: int = Field(default=1, gt=0)
    learning_rate: float = Field(default=1e-4, gt=0)
    weight_decay: float = Field(default=0.0, ge=0)
    warmup_ratio: float = Field(default=0.015, ge=0, lt=1)
    max_grad_norm: float = Field(default=0.5, gt=0)
    mixed_precision: Literal["no", "bf16"] = "no"
    ttt_length: int = Field(default=7, gt=0, description="EAGLE-3 training-time-test steps")
    ttt_step_decay: float = Field(default=0.8, gt=0)
    noise_std: float = Field(default=0.2, ge=0, description="EAGLE: uniform feature noise scale")
    feature_loss_weight: float = Field(default=1.0, ge=0)
    token_loss_weight: float = Field(default=0.1, ge=0)
    eval_max_k: int = Field(default=8, gt=0, description="simulated acceptance reported for k = 1..eval_max_k")
    save_every_steps: int = Field(default=200, gt=0)
    keep_checkpoints: int = Field(default=2, gt=0)
    log_every_steps: int = Field(default=10, gt=0)
    seed: int = 0
    num_workers: int = Field(default=0, ge=0)


class Recipe(_Section):
    # `model` is one trainable method's section (its `head_type` picks which); see `recipe_schema`.
    model: SerializeAsAny[RecipeModelSection]
    data: DataSection
    training: TrainingSection


_schema: tuple[int, type[Recipe]] | None = None


def recipe_schema() -> type[Recipe]:
    """`Recipe` whose `model` section is the union of the trainable methods' sections, discriminated by
    `head_type`; rebuilt when a method registers."""
    global _schema
    if _schema is None or _schema[0] != registry_version():
        sections = tuple(m.recipe_section for m in METHODS.values() if trainable(m))
        union = Annotated[Union[sections], Field(discriminator="head_type")] if len(sections) > 1 else sections[0]  # noqa: UP007
        _schema = (registry_version(), create_model("Recipe", __base__=Recipe, model=(union, ...)))
    return _schema[1]


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """`training.learning_rate=3e-4` style overrides; values are parsed as YAML (numbers, lists, null)."""
    for item in overrides:
        if "=" not in item:
            raise DraftsmithError(f"override {item!r} must look like section.key=value")
        dotted, raw = item.split("=", 1)
        keys = dotted.split(".")
        node = data
        for key in keys[:-1]:
            node = node.setdefault(key, {})
            if not isinstance(node, dict):
                raise DraftsmithError(f"override {item!r}: {key!r} is not a section")
        node[keys[-1]] = yaml.safe_load(raw)
    return data


def load_recipe(path: str | Path, overrides: list[str] | None = None) -> Recipe:
    path = Path(path)
    if not path.is_file():
        raise DraftsmithError(f"recipe {path} does not exist")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise DraftsmithError(f"recipe {path} is not valid YAML: {exc}") from None
    data = apply_overrides(data, overrides or [])
    return validate_recipe(data, str(path))


def validate_recipe(data: dict[str, Any], where: str = "recipe") -> Recipe:
    head_type = (data.get("model") or {}).get("head_type") if isinstance(data.get("model"), dict) else None
    if head_type is not None and (head_type not in METHODS or not trainable(METHODS[head_type])):
        raise DraftsmithError(f"recipe {where}: model.head_type: {unknown_method_message(head_type, 'trained')}")
    try:
        return recipe_schema()(**data)
    except ValidationError as exc:
        raise DraftsmithError(f"recipe {where}: {format_validation_error(exc)}") from None


def dump_recipe(recipe: Recipe) -> str:
    return yaml.safe_dump(recipe.model_dump(), sort_keys=False)
