"""Draft models: an independent small LM with the target's tokenizer drafts k tokens from its own KV cache, kept
in step with what the target accepts. Token by token it needs no training (any model of a family the runtime
runs); with `parallel_drafting: true` (PARD) a draft adapted by `draftsmith train` (head_type draft_model)
drafts all k from mask tokens in one forward. With `draft_sample_method: probabilistic` it samples its drafts
from its own distribution."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator

from draftsmith.errors import DraftsmithError
from draftsmith.methods.base import MethodNeeds, SpecMethod
from draftsmith.methods.eagle import HeadSpeculativeConfig
from draftsmith.methods.recipe_sections import RecipeModelSection, RecipeTrainingSection
from draftsmith.methods.registry import register_method


class DraftModelConfig(HeadSpeculativeConfig):
    method: Literal["draft_model"]
    # vLLM's key for PARD: one forward drafts all k from mask tokens (the draft's config.json names the token)
    parallel_drafting: bool = False


class DraftModelRecipe(RecipeModelSection):
    """PARD adaptation: `draft` (an HF checkpoint with the target's tokenizer) learns to draft in parallel."""

    head_type: Literal["draft_model"]
    draft: str = Field(description="HF directory of the draft LM to adapt (same tokenizer as the target)")
    pard_token: int | None = Field(default=None, description="the mask token id; default: the draft tokenizer's "
                                   "pad token, an id no text encodes to")

    @field_validator("aux_layer_ids", "intermediate_size", "init_from")
    @classmethod
    def _not_for_draft_models(cls, value, info):
        if value is not None:
            hint = " (to continue an adapted draft, name it as model.draft)" if info.field_name == "init_from" else ""
            raise ValueError(f"a draft model is a whole LM, adapted as it is: drop {info.field_name}{hint}")
        return value


class ParallelDraftTraining(RecipeTrainingSection):
    parallel_draft_tokens: int = Field(default=8, ge=2, le=32, description="K: tokens one forward drafts "
                                       "(the real token's prediction and K - 1 masks; PARD trains 8)")
    cod_retention: float = Field(default=0.7, gt=0, le=1, description="COD: depth i keeps this ** i of positions")
    cod_min_retention: float = Field(default=0.2, gt=0, le=1, description="COD: ... and never fewer than this")


@register_method
class DraftModelMethod(SpecMethod):
    name = "draft_model"
    section = DraftModelConfig
    # "model" required (a model directory, not a head); drafts sampled with a real q; a KV cache of its own
    needs = MethodNeeds(head=True, draft_probs=True, own_kv_cache=True)
    recipe_section = DraftModelRecipe
    training_section = ParallelDraftTraining
    proposer_ref = ".proposer:DraftModelProposer"
    objective_ref = ".objective:pard_objective"
    acceptance_eval_ref = ".objective:simulated_acceptance"

    @classmethod
    def default_feature_layers(cls, num_layers: int) -> tuple[int, ...]:
        return ()  # trains on text alone: no target layers, no target forward per batch

    @classmethod
    def record_training(cls, head, training: ParallelDraftTraining) -> None:
        head.config.parallel_draft_tokens = training.parallel_draft_tokens

    @classmethod
    def build_head(cls, section: DraftModelRecipe, target, feature_layers, token_records):
        from draftsmith.methods.draft_model.head import ParallelDraftLM
        from draftsmith.methods.heads import default_mask_token
        from draftsmith.models.loader import load_target
        from draftsmith.models.tokenizer import check_same_vocabulary, load_tokenizer

        draft = Path(section.draft)
        if not (draft / "config.json").is_file():
            raise DraftsmithError(f"model.draft: {draft} is not a model directory (no config.json)")
        lm = load_target(draft, dtype="float32")
        if lm.config.vocab_size != target.config.vocab_size:
            raise DraftsmithError(f"model.draft {draft} has a vocabulary of {lm.config.vocab_size} tokens, the target "
                                  f"{target.config.vocab_size}: a draft model must share the target's tokenizer")
        check_same_vocabulary(load_tokenizer(section.target), draft, "model.draft")
        mask = section.pard_token if section.pard_token is not None else default_mask_token(draft, "model.pard_token")
        return ParallelDraftLM.adapt(lm, draft, mask)

