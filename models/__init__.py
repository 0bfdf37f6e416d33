"""Model code shared by training and serving: the Llama-family target runtime, its KV cache, attention and
linear kernels, and the bases draft heads are built from (`heads`, `draft_layer`, `head_configs`). Each
head itself lives in its method's folder (`draftsmith/methods/<name>/head.py`)."""

from draftsmith.models.config import ARCHITECTURES, TargetConfig
from draftsmith.models.head_configs import HeadConfig
from draftsmith.models.heads import DraftHead, DraftHeadConfig
from draftsmith.models.kv_cache import ForwardBatch, KVCache
from draftsmith.models.llama import CausalLM, ForwardOutput
from draftsmith.models.loader import load_target

__all__ = ["ARCHITECTURES", "CausalLM", "DraftHead", "DraftHeadConfig", "ForwardBatch",
           "ForwardOutput", "HeadConfig", "KVCache", "TargetConfig", "load_target"]
