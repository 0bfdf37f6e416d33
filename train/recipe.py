"""Training recipes: YAML validated by pydantic (`extra="forbid"`), with `section.key=value` overrides.

The `model:` and `training:` sections belong to the method that trains the head (`model.head_type`): each
trainable method declares its own, so method-specific keys (EAGLE-3's `draft_vocab_size` and `ttt_length`,
EAGLE's `noise_std`) are valid exactly where they apply."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, SerializeAsAny, ValidationError, create_model

from draftsmith.errors import DraftsmithError, format_validation_error
from draftsmith.methods import METHODS, RecipeModelSection, RecipeTrainingSection, trainable
from draftsmith.methods.registry import unknown_method_message


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class DataSection(_Section):
    train_files: list[str] = Field(min_length=1, description="JSONL (optionally .xz/.gz): chat or text records")
    eval_files: list[str] | None = None
    format: Literal["auto", "chat", "text"] = "auto"
    max_length: int = Field(default=2048, gt=1)
    mask_prompt: bool = Field(default=False, description="text records with a 'prompt' (`draftsmith datagen` writes "
                              "it): learn only the tokens after it, the regenerated part, where a head drafts")
    max_train_samples: int | None = Field(default=None, gt=0)
    max_eval_samples: int | None = Field(default=200, gt=0)
    eval_fraction: float = Field(default=0.02, ge=0, lt=1, description="held back when eval_files is unset")
    hidden_states_dir: str | None = Field(default=None, description="offline mode: read `draftsmith capture` output")
    hidden_states_dtype: Literal["bfloat16", "float32", "fp8"] = Field(
        default="bfloat16", description="how features are stored (`draftsmith capture`) and rounded online: fp8 is "
        "E4M3 with a scale per token and layer, half bf16's bytes; training computes in bf16 from it")


class DatagenRun(_Section):
    """One run of `draftsmith datagen --recipe`: its flags as keys (ranges and choices are datagen's own, checked
    when it runs); `model` defaults to the recipe's model.target."""

    input: str
    output: str
    model: str | None = None
    num_samples: int | None = None
    skip_samples: int | None = None
    max_tokens: int | None = None
    prompt_tokens: int | None = None
    cut: Literal["start", "block"] | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    dtype: str | None = None
    device: str | None = None
    max_num_seqs: int | None = None
    max_model_len: int | None = None
    logprobs_mode: str | None = None
    enforce_eager: bool | None = None
    step_mode: str | None = None
    speculative_config: str | dict[str, Any] | list[dict[str, Any]] | None = None
    engine: Literal["draftsmith", "vllm"] | None = None
    vllm_python: str | None = None
    tensor_parallel_size: int | None = None
    data_parallel_size: int | None = None


class Recipe(_Section):
    # `model` and `training` are the sections of the method that trains the head (`model.head_type`
    # picks it; see `recipe_schema`), so each method's keys are valid exactly in its own recipes.
    model: SerializeAsAny[RecipeModelSection]
    data: DataSection
    training: SerializeAsAny[RecipeTrainingSection]
    datagen: list[DatagenRun] | None = Field(
        default=None, description="runs of `draftsmith datagen --recipe` that regenerate this recipe's data with "
        "model.target: each `draftsmith datagen` flags as keys (num_samples: 4800, engine: vllm, ...)")


_schemas: dict[str, tuple[type, type[Recipe]]] = {}


def recipe_schema(head_type: str) -> type[Recipe]:
    """`Recipe` with the `model` and `training` sections of the method registered for `head_type`."""
    method = METHODS[head_type]
    cached = _schemas.get(head_type)
    if cached is None or cached[0] is not method:  # a method re-registered under the name gets a new schema
        schema = create_model(f"Recipe_{head_type}", __base__=Recipe, model=(method.recipe_section, ...),
                              training=(method.training_section, ...))
        _schemas[head_type] = cached = (method, schema)
    return cached[1]


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
    head_type = data["model"].get("head_type") if isinstance(data.get("model"), dict) else None
    if isinstance(head_type, str) and (head_type not in METHODS or not trainable(METHODS[head_type])):
        raise DraftsmithError(f"recipe {where}: model.head_type: {unknown_method_message(head_type, 'trained')}")
    try:
        return (recipe_schema(head_type) if isinstance(head_type, str) else Recipe)(**data)
    except ValidationError as exc:
        raise DraftsmithError(f"recipe {where}: {format_validation_error(exc)}") from None


def dump_recipe(recipe: Recipe) -> str:
    return yaml.safe_dump(recipe.model_dump(), sort_keys=False)
