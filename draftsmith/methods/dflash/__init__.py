"""DFlash: a block drafter. Target features from a few layers become every draft layer's context keys and
values; one non-causal forward over [bonus token, masks] drafts the whole block through the target's own
LM head (`draftsmith.methods.dflash.head`). Trained on anchors sampled along each sequence, a block predicted from
each, the loss of block position j weighted exp(-(j - 1) / gamma) (speculators' and SpecForge's scheme)."""

from __future__ import annotations

from typing import ClassVar, Literal

import torch
from pydantic import Field

from draftsmith.methods.base import MethodNeeds, SpecMethod
from draftsmith.methods.dflash.head import DFlashConfig, DFlashHead
from draftsmith.methods.eagle import EagleTreeConfig
from draftsmith.methods.recipe_sections import RecipeModelSection, RecipeTrainingSection
from draftsmith.methods.registry import register_method


class DFlashSpecConfig(EagleTreeConfig):
    """A chain of num_speculative_tokens drafts (at most the head's: block_size - 1, or block_size anchor-first),
    or a tree from the same one block forward (`methods.draft_trees`): vLLM's static `speculative_token_tree`,
    or `tree_depth` (at most the head's drafts) and `tree_top_k` for EAGLE-2's dynamic tree grown from the block's per-depth distributions,
    of which the engine verifies the likeliest nodes, up to num_speculative_tokens."""

    method: Literal["dflash"]


class DFlashRecipe(RecipeModelSection):
    head_type: Literal["dflash"]
    block_size: int = Field(default=9, ge=2, le=64, description="bonus token + masks: drafts block_size - 1 a step "
                            "(block_size anchor-first)")
    sample_from_anchor: bool = Field(default=False, description=(
        "the block layout (speculators' key): false, DFlash's 1+N (block position i predicts the token at i); true, "
        "DSpark's anchor-first (position i predicts the token after it, the anchor's output is the first draft)"))
    num_draft_layers: int = Field(default=1, gt=0, description="decoder layers (z-lab's Qwen3 drafts have 5)")
    mask_token_id: int | None = Field(default=None, description="default: the target tokenizer's pad token")
    sliding_window: int | None = Field(default=None, gt=0, description=(
        "each block position attends over the newest this many positions up to its own and the rest of its block, "
        "in training and serving, as vLLM's dflash_config.use_swa (set it to data.max_length to serve no wider a "
        "context than the head trained on); default: the whole context"))
    CONFIG_NAMES: ClassVar[dict[str, str]] = {"num_draft_layers": "num_hidden_layers"}


class DFlashTraining(RecipeTrainingSection):
    num_anchors: int = Field(default=16, gt=0, description="blocks predicted per sequence, from random anchors")
    loss_decay_gamma: float = Field(default=4.0, gt=0, description="block position j weighs exp(-(j-1)/gamma)")
    loss_positions: int | None = Field(default=None, gt=0, description=(
        "drafts 1..n learn (default: all the block's); the later ones, whose decayed weight is small, "
        "then cost no LM head"))


@register_method
class DFlashMethod(SpecMethod):
    name = "dflash"
    section = DFlashSpecConfig
    needs = MethodNeeds(hidden_states=True, draft_probs=True, own_kv_cache=True, head=True, parallel=True, tree=True)
    head_type = "dflash"
    head_config = DFlashConfig
    head_module = DFlashHead
    recipe_section = DFlashRecipe
    training_section = DFlashTraining
    converters = (".convert",)
    proposer_ref = ".proposer:DFlashProposer"
    objective_ref = ".objective:dflash_objective"
    acceptance_eval_ref = ".objective:simulated_acceptance"

    @classmethod
    def default_feature_layers(cls, num_layers: int) -> tuple[int, ...]:
        """Three target layers spread from the first to the last decoder layer (HF hidden_states indices)."""
        if num_layers < 3:
            return tuple(range(1, num_layers + 1))
        return tuple(sorted({round(1 + i * (num_layers - 2) / 2) for i in range(3)}))

    @classmethod
    def head_fields(cls, section: DFlashRecipe) -> dict:
        """Config fields of a head built on DFlash's that its own recipe keys set (none here)."""
        return {}

    @classmethod
    def build_head(cls, section: DFlashRecipe, target, feature_layers, token_records):
        from draftsmith.methods.heads import default_mask_token

        t = target.config
        mask = section.mask_token_id if section.mask_token_id is not None else \
            default_mask_token(section.target, "model.mask_token_id")
        config = cls.head_config(hidden_size=t.hidden_size, intermediate_size=section.intermediate_size or t.intermediate_size,
                              num_hidden_layers=section.num_draft_layers, num_attention_heads=t.num_attention_heads,
                              num_key_value_heads=t.num_key_value_heads, head_dim=t.head_dim, vocab_size=t.vocab_size,
                              target_hidden_size=t.hidden_size, target_num_layers=t.num_hidden_layers,
                              aux_layer_ids=tuple(feature_layers), block_size=section.block_size, mask_token_id=mask,
                              sample_from_anchor=section.sample_from_anchor,
                              rms_norm_eps=t.rms_norm_eps, rope=t.rope, max_position_embeddings=t.max_position_embeddings,
                              attention_bias=t.qkv_bias, target_model=section.target,
                              sliding_window=section.sliding_window, **cls.head_fields(section))
        config.check_target(t)
        head = cls.head_module(config).attach_target(target)
        if section.intermediate_size in (None, t.intermediate_size) and section.num_draft_layers <= t.num_hidden_layers:
            _start_from_last_layers(head, target)
        return head


@torch.no_grad()
def _start_from_last_layers(head: DFlashHead, target) -> None:
    """Draft layers start as copies of the target's last ones (q/k norms at 1), the final norm as the
    target's: the block's outputs are read by the target's LM head from the first step. (A head with other
    shapes, or more layers than the target, starts random.)"""
    from draftsmith.methods.heads import start_from_target_layers

    start_from_target_layers(head.layers, target, "DFlash",
                             "set model.intermediate_size to a value other than the target's")
    head.norm.weight.copy_(target.model.norm.weight.float())

