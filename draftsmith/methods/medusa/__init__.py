"""Medusa: parallel ResBlock heads over the target's last hidden state.

Converts (`draftsmith convert`) to and from the native format; no proposer or objective yet, so
`--speculative-config` and recipes refuse it with a message listing the methods that can."""

from __future__ import annotations

from typing import Literal

from draftsmith.methods.base import MethodNeeds, SpecMethod, SpeculativeConfig
from draftsmith.methods.registry import register_method
from draftsmith.models.head_configs import MedusaConfig


class MedusaSpecConfig(SpeculativeConfig):
    method: Literal["medusa"]


@register_method
class MedusaMethod(SpecMethod):
    name = "medusa"
    section = MedusaSpecConfig
    needs = MethodNeeds(hidden_states=True, head=True)
    head_type = "medusa"
    head_config = MedusaConfig
    converters = ("draftsmith.convert.medusa",)
