"""Multi-token-prediction layers shipped inside the target checkpoint (DeepSeek-V3, Qwen3-Next, MiMo).

Converts (`draftsmith convert`) to and from the native format; no proposer or objective yet, so
`--speculative-config` and recipes refuse it with a message listing the methods that can."""

from __future__ import annotations

from typing import Literal

from draftsmith.methods.base import MethodNeeds, SpecMethod, SpeculativeConfig
from draftsmith.methods.registry import register_method
from draftsmith.models.head_configs import MTPConfig


class MTPSpecConfig(SpeculativeConfig):
    method: Literal["mtp"]


@register_method
class MTPMethod(SpecMethod):
    name = "mtp"
    section = MTPSpecConfig
    needs = MethodNeeds(hidden_states=True, head=True)
    head_type = "mtp"
    head_config = MTPConfig
    converters = ("draftsmith.convert.mtp",)
