"""Speculation methods, one folder each, and their registry.

A method's folder holds everything draftsmith knows about it: `__init__.py` registers a `SpecMethod`
subclass (its `--speculative-config` section, recipe section, head type, declared needs, default feature
layers) and names, as `*_ref` strings, the parts each layer loads on demand: `proposer.py` for the engine,
`objective.py` for the trainer; `head.py` is its head module (one implementation for training and
serving) and `convert.py` its `draftsmith convert` formats (named by `converters`). The bases they share
stay in `draftsmith.models` (`heads`, `draft_layer`, `head_configs`).

Methods are found, not listed: every package in this folder is imported here, and so is every entry point
another distribution declares in the `draftsmith.methods` group (`methods.plugins`). Adding a method is
adding a folder, or installing a package that declares one.
"""

from draftsmith.methods.base import MethodNeeds, SpecMethod
from draftsmith.methods.heads import load_head, read_head_config
from draftsmith.methods.proposer_base import DraftBatch, Proposer
from draftsmith.methods.recipe_sections import RecipeModelSection, RecipeTrainingSection
from draftsmith.methods.registry import (
    METHODS,
    head_method,
    method_names,
    register_method,
    resolve_method,
    servable,
    trainable,
    unregister_method,
)
from draftsmith.methods.speculative_config import SpeculativeConfig

# isort: split
from draftsmith.methods.plugins import register_builtin_methods, register_plugin_methods

register_builtin_methods(__name__, __path__)
register_plugin_methods()

__all__ = ["METHODS", "DraftBatch", "MethodNeeds", "Proposer", "RecipeModelSection", "RecipeTrainingSection",
           "SpecMethod", "SpeculativeConfig", "head_method", "load_head", "method_names", "read_head_config",
           "register_method", "resolve_method", "servable", "trainable", "unregister_method"]
