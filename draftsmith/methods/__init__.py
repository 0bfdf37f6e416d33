"""Speculation methods, one folder each, and their registry.

A method's folder holds everything draftsmith knows about it: `__init__.py` registers a `SpecMethod`
subclass (its `--speculative-config` section, recipe section, head type, declared needs, default fused
layers) and its other modules hold the parts each layer loads on demand: `proposer.py` for the engine,
`objective.py` for the trainer; converter formats are named by module and loaded by `draftsmith convert`.
Head modules and native configs stay in `draftsmith.models` (model code lives once, for training and
serving); a method points at them. Adding a method is adding a folder, one import line below and its
package name in pyproject.toml.
"""

from draftsmith.methods.base import (
    DraftBatch,
    MethodNeeds,
    Proposer,
    RecipeModelSection,
    RecipeTrainingSection,
    SpecMethod,
    SpeculativeConfig,
)
from draftsmith.methods.heads import load_head, read_head_config
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

# isort: split
# Importing a built-in method registers it (explicit, in one place: no import-time scanning).
from draftsmith.methods import dflash, draft_model, eagle, eagle3, medusa, mlp_speculator, mtp, ngram, suffix  # noqa: F401

__all__ = ["METHODS", "DraftBatch", "MethodNeeds", "Proposer", "RecipeModelSection", "RecipeTrainingSection",
           "SpecMethod", "SpeculativeConfig", "head_method", "load_head", "method_names", "read_head_config",
           "register_method", "resolve_method", "servable", "trainable", "unregister_method"]
