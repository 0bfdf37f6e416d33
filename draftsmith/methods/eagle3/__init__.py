"""EAGLE-3: a head (one decoder layer, or a stack) fusing three target layers, with its own LM head over a draft vocabulary
chosen by token frequency, trained with training-time test (its own outputs fed back for several steps)."""

from __future__ import annotations

from dataclasses import replace
from typing import ClassVar, Literal

import torch
from pydantic import Field, model_validator

from draftsmith.errors import DraftsmithError
from draftsmith.methods.eagle import EagleFamilyMethod, EagleTreeConfig
from draftsmith.methods.eagle3.head import Eagle3Head
from draftsmith.methods.recipe_sections import RecipeModelSection, RecipeTrainingSection
from draftsmith.methods.registry import register_method
from draftsmith.models.heads import DraftHeadConfig


class Eagle3Config(EagleTreeConfig):
    """`parallel_drafting` (vLLM's key): P-EAGLE, all num_speculative_tokens drafts from one head forward,
    for a head trained to (its `mask_hidden`); a chain, not a tree."""

    method: Literal["eagle3"]
    parallel_drafting: bool = False

    @model_validator(mode="after")
    def _parallel_chains(self):
        if self.parallel_drafting and (self.speculative_token_tree is not None or self.tree_depth is not None):
            raise ValueError("parallel_drafting drafts a chain in one forward: it takes no speculative_token_tree, "
                             "tree_depth or tree_top_k")
        return self


class Eagle3Recipe(RecipeModelSection):
    head_type: Literal["eagle3"]
    draft_vocab_size: int | None = Field(default=None, gt=0, description="default: the target's vocab")
    # the variants speculators trains (its names; its defaults turn on the first three)
    norm_before_residual: bool = Field(default=False, description="the layer's residual is its normed input")
    norm_before_fc: bool = Field(default=False, description="one RMSNorm over the fused target features before fc")
    fc_norm: bool = Field(default=False, description="an RMSNorm per fused target layer before fc")
    norm_output: bool = Field(default=False, description="feed the final norm's output back (EAGLE 3.1)")
    qk_norm: bool = Field(default=False, description="Qwen3-style draft layer: RMSNorm of queries and keys")
    sliding_window: int | None = Field(default=None, gt=0, description="draft attention window, in positions")
    num_draft_layers: int = Field(default=1, gt=0, description=(
        "decoder layers (vLLM's num_hidden_layers): the first reads [embedding; hidden], later ones the residual "
        "stream; with init_from a head of fewer layers, the new ones start as the identity"))
    parallel_drafting: bool = Field(default=False, description=(
        "P-EAGLE: train drafts 2..ttt_length to come from slots of mask_token_id with a learned shared hidden "
        "input (mask_hidden), so that serving drafts them all in one forward"))
    ptd_token_id: int | None = Field(default=None, description="P-EAGLE's slot token (vLLM's key); default: "
                                     "the target tokenizer's pad token")
    layers_from_target: bool = Field(default=False, description=(
        "layers after the first start as copies of the target's last num_draft_layers - 1 decoder layers (as "
        "DFlash's do), not random; grown onto a saved head (init_from), with their output projections at zero, so "
        "that the head drafts as before until training moves them"))
    CONFIG_NAMES: ClassVar[dict[str, str]] = {"num_draft_layers": "num_hidden_layers"}
    START_ONLY: ClassVar[frozenset[str]] = frozenset({"layers_from_target"})

    @model_validator(mode="after")
    def _one_fc_norm(self):
        if self.norm_before_fc and self.fc_norm:
            raise ValueError("norm_before_fc and fc_norm exclude each other: set one")
        return self


class Eagle3Training(RecipeTrainingSection):
    ttt_length: int = Field(default=7, gt=0, description="training-time-test steps unrolled per batch")
    ttt_step_decay: float = Field(default=0.8, gt=0, description="loss weight of step s is decay**s")
    num_anchors: int | None = Field(default=None, gt=0, description=(
        "positions a sequence at which steps after the first train, drawn at random each batch (step 0 runs at "
        "every position); default: every position"))


@register_method
class Eagle3Method(EagleFamilyMethod):
    name = "eagle3"
    section = Eagle3Config
    recipe_section = Eagle3Recipe
    training_section = Eagle3Training
    head_type = "eagle3"
    head_module = Eagle3Head
    converters = (".convert", "draftsmith.methods.formats.speculators")
    objective_ref = ".objective:eagle3_objective"

    @classmethod
    def reference_feature_layers(cls, num_layers: int) -> tuple[int, ...]:
        """What the EAGLE-3 reference code fuses (HF hidden_states indexing), so what a checkpoint whose config
        names no layers was trained on: it repeats or runs backwards on targets of 6 layers or fewer."""
        return (2, num_layers // 2, num_layers - 3)

    @classmethod
    def default_feature_layers(cls, num_layers: int) -> tuple[int, ...]:
        """The reference choice where its three layers are distinct and in order; on targets of 6 layers or fewer
        ([2, 3, 3] for 6, which speculators refuses), three distinct layers spread evenly over the decoder's
        inner outputs instead ([1, 3, 5] for 6)."""
        reference = cls.reference_feature_layers(num_layers)
        if reference[0] < reference[1] < reference[2]:
            return reference
        if num_layers < 2:
            raise DraftsmithError(f"an EAGLE-3 head fuses 3 distinct target layers; a {num_layers}-layer target "
                                  "has too few (hidden_states indices 0..1)")
        # inner outputs 1..L-1 where there are three, else the embedding and the final output too
        low, high = (1, num_layers - 1) if num_layers >= 4 else (0, num_layers)
        return tuple(round(low + (high - low) * i / 2) for i in range(3))

    @classmethod
    def head_config_overrides(cls, section: Eagle3Recipe) -> dict:
        overrides = {name: getattr(section, name) for name in DraftHeadConfig.VARIANTS}
        if section.draft_vocab_size:
            overrides["draft_vocab_size"] = section.draft_vocab_size
        overrides["num_hidden_layers"] = section.num_draft_layers
        if section.parallel_drafting:
            from draftsmith.methods.heads import default_mask_token

            mask = section.ptd_token_id if section.ptd_token_id is not None else \
                default_mask_token(section.target, "model.ptd_token_id")
            overrides.update(parallel_drafting=True, ptd_token_id=mask)
        return overrides

    @classmethod
    def build_head(cls, section, target, feature_layers, token_records):
        from draftsmith.methods.eagle3.vocab import draft_vocab_from_frequencies

        head = super().build_head(section, target, feature_layers, token_records)
        c = head.config
        head.init_draft_vocab(draft_vocab_from_frequencies(token_records, c.vocab_size, c.draft_vocab_size))
        if section.layers_from_target:
            _start_from_target(list(head.layers.values()), target)
        if c.parallel_drafting:  # speculators' start: a random shared hidden input
            torch.nn.init.normal_(head.mask_hidden)
        return head

    @classmethod
    def continue_head(cls, head, section: Eagle3Recipe, target):
        """`init_from` a head with fewer layers than `num_draft_layers` names, or a sequential head under
        `parallel_drafting`: the same head grown (the new layers the identity at first: random inside, or the
        target's last layers with `layers_from_target`) and made P-EAGLE (its `mask_hidden` random: what
        parallel slots read is all it has not learned); a `sliding_window` the recipe names replaces the saved
        head's (the weights do not depend on it). Keys the recipe leaves out keep the saved head's."""
        c = head.config
        layers = section.num_draft_layers if "num_draft_layers" in section.model_fields_set else c.num_hidden_layers
        parallel = section.parallel_drafting or c.parallel_drafting
        window = section.sliding_window if "sliding_window" in section.model_fields_set else c.sliding_window
        if layers < c.num_hidden_layers:
            raise DraftsmithError(f"model.init_from: the saved head has {c.num_hidden_layers} layers, more than "
                                  f"model.num_draft_layers {layers}")
        if layers == c.num_hidden_layers and parallel == c.parallel_drafting and window == c.sliding_window:
            return head
        fields = cls.head_config_overrides(section) if parallel and not c.parallel_drafting else {}
        grown = type(head)(replace(c, num_hidden_layers=layers, parallel_drafting=parallel, sliding_window=window,
                                   ptd_token_id=fields.get("ptd_token_id", c.ptd_token_id)))
        missing, unexpected = grown.load_state_dict(head.state_dict(), strict=False)
        new_layers = [str(i) for i in range(c.num_hidden_layers, layers)]
        expected = {n for n in grown.state_dict() if n.split(".")[0] == "layers" and n.split(".")[1] in new_layers}
        if parallel and not c.parallel_drafting:
            expected.add("mask_hidden")
        if set(missing) != expected or unexpected:
            raise DraftsmithError(f"model.init_from: the saved head does not fit a {layers}-layer"
                                  f"{' P-EAGLE' if parallel else ''} one (missing {sorted(set(missing) - expected)}, "
                                  f"unexpected {unexpected})")
        if "mask_hidden" in expected:
            torch.nn.init.normal_(grown.mask_hidden)
        if section.layers_from_target:
            _start_from_target([grown.layers[name] for name in new_layers], target)
        grown.start_layers_as_identity(new_layers)
        return grown


def _start_from_target(layers: list, target) -> None:
    from draftsmith.methods.heads import start_from_target_layers

    start_from_target_layers(layers, target, "EAGLE-3", "drop model.layers_from_target")
