"""IBM/fms MLP speculator: n_predict MLP stages over the target's last hidden state.

Converts (`draftsmith convert`) to and from the native format; no proposer or objective yet, so
`--speculative-config` and recipes refuse it with a message listing the methods that can."""

from __future__ import annotations

from typing import Literal

from draftsmith.methods.base import MethodNeeds, SpecMethod, SpeculativeConfig
from draftsmith.methods.registry import register_method
from draftsmith.models.head_configs import MLPSpeculatorConfig


class MLPSpeculatorSpecConfig(SpeculativeConfig):
    method: Literal["mlp_speculator"]


@register_method
class MLPSpeculatorMethod(SpecMethod):
    name = "mlp_speculator"
    section = MLPSpeculatorSpecConfig
    needs = MethodNeeds(hidden_states=True, head=True)
    head_type = "mlp_speculator"
    head_config = MLPSpeculatorConfig
    converters = ("draftsmith.convert.mlp_speculator",)
