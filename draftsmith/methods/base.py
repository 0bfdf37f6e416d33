"""What a speculation method is: the plugin contract between a method's folder and the rest of draftsmith.

A method is one registered `SpecMethod` subclass. Its class body is declarative and cheap to import (a
pydantic section for `--speculative-config`, a recipe section, its head type, its declared `MethodNeeds`),
so the registry can list every method without importing the engine or the trainer. The heavy parts it
owns (its `Proposer`, its training objective, its converter formats) are returned by the class's hooks,
which import them from the method's own folder only when a layer asks: the engine asks for proposers,
the trainer for objectives, `draftsmith convert` for formats. `train` and `convert` therefore never load
serving code, and serving never loads training code.

The contract's other parts have modules of their own: `speculative_config`, `recipe_sections`, and
`proposer_base` (what the engine knows of a proposer).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from draftsmith.errors import DraftsmithError
from draftsmith.methods.proposer_base import Proposer
from draftsmith.methods.recipe_sections import RecipeModelSection, RecipeTrainingSection
from draftsmith.methods.speculative_config import SpeculativeConfig


@dataclass(frozen=True)
class MethodNeeds:
    """What a method declares about itself; the engine and config checks read these flags, never method names.

    Read today: `hidden_states` (the engine hands the proposer target features), `draft_probs` (whether
    draft_sample_method "probabilistic" is allowed), `head` ("model" required), `parallel` (the bench drafts a
    shipped head's whole block). `own_kv_cache` and `tree` (its config section takes tree keys; the engine
    reads trees from `DraftBatch.parents`) are declared only: nothing reads them yet."""

    hidden_states: bool = False  # needs target features from every forward (EAGLE family, MTP)
    draft_probs: bool = False  # can sample its drafts and hand back q (draft_sample_method=probabilistic)
    own_kv_cache: bool = False  # keeps a per-slot cache of its own, in step with the target's
    head: bool = False  # loads a trained head: the config's "model" key is required
    tree: bool = False  # drafts trees (DraftBatch.parents) when given one, not only chains
    parallel: bool = False  # drafts all k tokens in one pass (PARD, DFlash)


class SpecMethod:
    """A speculation method: subclass, set the class attributes, register with `@register_method`."""

    name: ClassVar[str] = ""
    section: ClassVar[type[SpeculativeConfig]]  # its --speculative-config section, `method: Literal[name]`
    needs: ClassVar[MethodNeeds] = MethodNeeds()
    head_type: ClassVar[str | None] = None  # the native head format it serves/trains, if any
    recipe_section: ClassVar[type[RecipeModelSection] | None] = None  # set when the method trains a head
    training_section: ClassVar[type[RecipeTrainingSection]] = RecipeTrainingSection
    head_config: ClassVar[type | None] = None  # the `HeadConfig` subclass of its native head format
    # the `nn.Module` that runs its head (training and serving); None while the head only converts
    head_module: ClassVar[type | None] = None
    # modules that register its `draftsmith convert` formats and exporters (relative as the refs below are),
    # imported by `load_formats` only
    converters: ClassVar[tuple[str, ...]] = ()
    # The parts each layer loads only when asked, as "module:name"; a module starting with "." is in the
    # package of the class that declares the reference (a method's folder). None: the method has no such part.
    proposer_ref: ClassVar[str | None] = None  # the engine's Proposer subclass
    objective_ref: ClassVar[str | None] = None  # the trainer's objective
    acceptance_eval_ref: ClassVar[str | None] = None  # the trainer's simulated acceptance

    @classmethod
    def proposer_class(cls) -> type[Proposer] | None:
        """The proposer the engine builds, or None when the method cannot be served (yet)."""
        return cls._resolve("proposer_ref")

    @classmethod
    def objective(cls) -> Callable[..., Any] | None:
        """`objective(head, target, batch, features, training_cfg) -> (loss, logs)`, or None if untrainable."""
        return cls._resolve("objective_ref")

    @classmethod
    def acceptance_eval(cls) -> Callable[..., Any] | None:
        """`evaluate(head, target, batch, features, max_k) -> (accepted chains per depth [max_k], chain
        starts)`, optionally followed by (tokens, blocks) of the batch drafted block after block as a server
        drafts it: the trainer's per-epoch simulated acceptance, or None to skip it."""
        return cls._resolve("acceptance_eval_ref")

    @classmethod
    def import_converters(cls) -> None:
        """Imports the modules named by `converters` (which register its convert formats)."""
        for module in cls.converters:
            importlib.import_module(module, cls._package_declaring("converters"))

    @classmethod
    def _resolve(cls, attribute: str):
        """The object a `*_ref` names, imported now; a relative module is resolved as a relative import in the
        module of the class that set the reference would be (a subclass elsewhere inherits what it meant)."""
        ref = getattr(cls, attribute)
        if ref is None:
            return None
        module, _, name = ref.partition(":")
        return getattr(importlib.import_module(module, cls._package_declaring(attribute)), name)

    @classmethod
    def _package_declaring(cls, attribute: str) -> str:
        """The package of the class that set `attribute` (what a relative module there is relative to)."""
        owner = next(k for k in cls.__mro__ if attribute in vars(k))
        return sys.modules[owner.__module__].__package__

    @classmethod
    def build_head(cls, section: RecipeModelSection, target, feature_layers: tuple[int, ...], token_records):
        """A freshly initialized head for `target` (the trainer's starting point). `token_records` iterates the
        training records ({"input_ids", "loss_mask"}) for methods that choose something from the data."""
        raise DraftsmithError(f"method {cls.name!r} does not train a head")

    @classmethod
    def continue_head(cls, head, section: RecipeModelSection, target):
        """The head `model.init_from` loaded, as the recipe continues it for `target` (most: as it is; EAGLE-3
        made parallel by `parallel_drafting`)."""
        return head

    @classmethod
    def record_training(cls, head, training: RecipeTrainingSection) -> None:
        """Notes on `head`, before training, what its saved checkpoint must know of how it was trained (PARD:
        how many tokens one forward learned to draft). Most heads carry all of it in their architecture."""

    @classmethod
    def default_feature_layers(cls, num_layers: int) -> tuple[int, ...]:
        """HF hidden_states indices its head reads from a `num_layers` target, when a recipe names none."""
        raise DraftsmithError(f"method {cls.name!r} reads no target layers")


class FinalHiddenMethod(SpecMethod):
    """What methods whose head reads only the target's final normed hidden state share (Medusa, MLP
    speculator): their needs and the one layer they read."""

    needs: ClassVar[MethodNeeds] = MethodNeeds(hidden_states=True, head=True, draft_probs=True)

    @classmethod
    def default_feature_layers(cls, num_layers: int) -> tuple[int, ...]:
        return (num_layers,)  # HF hidden_states[L]: after the final norm, what the target's LM head reads
