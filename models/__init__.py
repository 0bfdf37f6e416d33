"""Model code shared by training and serving: the Llama-family target runtime, its KV cache, and the
draft-head modules and native configs (which method uses which head is the method registry's business)."""

from draftsmith.models.config import ARCHITECTURES, TargetConfig
from draftsmith.models.eagle import EagleHead
from draftsmith.models.eagle3 import Eagle3Head
from draftsmith.models.head_configs import HeadConfig
from draftsmith.models.heads import DraftHead, DraftHeadConfig
from draftsmith.models.kv_cache import ForwardBatch, KVCache
from draftsmith.models.llama import CausalLM, ForwardOutput
from draftsmith.models.loader import load_target

__all__ = ["ARCHITECTURES", "CausalLM", "DraftHead", "DraftHeadConfig", "Eagle3Head", "EagleHead", "ForwardBatch",
           "ForwardOutput", "HeadConfig", "KVCache", "TargetConfig", "load_target"]
