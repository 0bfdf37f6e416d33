"""Model code shared by training and serving: target runtime (Llama family) and, later, draft heads."""

from draftsmith.models import eagle, eagle3  # noqa: F401  (registers the head types)
from draftsmith.models.config import ARCHITECTURES, TargetConfig
from draftsmith.models.heads import HEADS, DraftHead, DraftHeadConfig, load_head
from draftsmith.models.kv_cache import ForwardBatch, KVCache
from draftsmith.models.llama import CausalLM, ForwardOutput
from draftsmith.models.loader import load_target

__all__ = ["ARCHITECTURES", "HEADS", "DraftHead", "DraftHeadConfig", "load_head", "CausalLM", "ForwardBatch", "ForwardOutput", "KVCache", "TargetConfig", "load_target"]
