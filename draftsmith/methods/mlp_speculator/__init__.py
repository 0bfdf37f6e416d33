"""IBM/fms MLP speculator: n_predict MLP stages over the target's last hidden state. Converts
(`draftsmith convert`) to and from the native format and serves (greedy drafts); no objective yet, so
recipes refuse it with a message listing the methods that train."""

from __future__ import annotations

from typing import Literal

from draftsmith.methods.base import MethodNeeds, SpecMethod, SpeculativeConfig
from draftsmith.methods.registry import register_method
from draftsmith.models.head_configs import MLPSpeculatorConfig
from draftsmith.models.mlp_speculator import MLPSpeculatorHead


class MLPSpeculatorSpecConfig(SpeculativeConfig):
    method: Literal["mlp_speculator"]


@register_method
class MLPSpeculatorMethod(SpecMethod):
    name = "mlp_speculator"
    section = MLPSpeculatorSpecConfig
    needs = MethodNeeds(hidden_states=True, head=True)
    head_type = "mlp_speculator"
    head_config = MLPSpeculatorConfig
    head_module = MLPSpeculatorHead
    converters = ("draftsmith.convert.mlp_speculator",)

    @classmethod
    def proposer_class(cls):
        from draftsmith.methods.mlp_speculator.proposer import MLPSpeculatorProposer

        return MLPSpeculatorProposer
