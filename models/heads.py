"""EAGLE-style draft heads: their shared config, the module base, and the native save/load format.

Native format (a directory): `config.json` with `draftsmith_head_type`, the target it was trained for
(`target_model`, `target_num_layers`, `target_hidden_size`, `vocab_size`), the fused target layers in HF
`hidden_states` indexing (`feature_layers`), `draft_vocab_size`; and `model.safetensors` with the head's own
weights. Tensors shared with the target (embedding; EAGLE-1's LM head) are not stored: the head is
attached to its target at load time, as vLLM and SGLang do.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from draftsmith.errors import DraftsmithError
from draftsmith.models.config import RopeConfig, TargetConfig
from draftsmith.models.head_configs import HeadConfig
from draftsmith.models.kv_cache import KVCache
from draftsmith.models.linear import Linear, make_plans, pack_weights_in
from draftsmith.models.rope import rope_tables


@dataclass
class DraftHeadConfig(HeadConfig):
    head_type: str
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # the target's
    draft_vocab_size: int
    target_hidden_size: int
    target_num_layers: int
    aux_layer_ids: tuple[int, ...]  # HF hidden_states indices fed to the head
    rms_norm_eps: float = 1e-5
    rope: RopeConfig = field(default_factory=RopeConfig)
    max_position_embeddings: int = 2048
    target_model: str = ""
    fc_bias: bool | None = None  # None: the head type's default (EAGLE-1 True, EAGLE-3 False), resolved at build
    attention_bias: bool = False  # q/k/v biases (EAGLE-1 heads for Qwen2 targets)
    own_embedding: bool = False  # the head has its own token embedding (EAGLE-3 heads narrower than the target)
    # EAGLE-3 variants current trainers write (speculators 0.9 trains the first three by default), under
    # speculators' names; EAGLE-1 heads have none of them
    norm_before_residual: bool = False  # the layer's residual is its normed hidden input, not the raw one
    norm_before_fc: bool = False  # one RMSNorm over the concatenated target features before fc (`input_norm`)
    fc_norm: bool = False  # an RMSNorm per fused target layer before fc (`fc_norm.i`; the EAGLE 3.1 paper)
    norm_output: bool = False  # the final norm's output is what the LM head reads and what is fed back (3.1)
    qk_norm: bool = False  # Qwen3-style draft layer: per-head RMSNorm of queries and keys before RoPE
    sliding_window: int | None = None  # the draft layer attends over the newest this many positions
    # P-EAGLE (EAGLE-3 only): drafts 2..k come from the same forward as draft 1, each a slot of token
    # `ptd_token_id` whose hidden input is the learned `mask_hidden` (a fused-feature vector, before fc)
    parallel_drafting: bool = False
    ptd_token_id: int | None = None
    num_hidden_layers: int = 1  # EAGLE-3 only: decoder layers, the first reading [emb; hidden] (vLLM's key)

    VARIANTS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output", "qk_norm", "sliding_window")

    def __post_init__(self) -> None:
        if self.norm_before_fc and self.fc_norm:
            raise DraftsmithError("norm_before_fc (one norm over all fused layers) and fc_norm (a norm per layer) "
                                  "exclude each other: set one")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise DraftsmithError(f"sliding_window must be a positive number of positions, not {self.sliding_window}")
        if self.parallel_drafting and (self.head_type != "eagle3" or self.ptd_token_id is None):
            raise DraftsmithError("parallel_drafting (P-EAGLE) is an EAGLE-3 head's, with the ptd_token_id its draft "
                                  "slots are filled with")
        if self.num_hidden_layers < 1 or (self.num_hidden_layers > 1 and self.head_type != "eagle3"):
            raise DraftsmithError(f"num_hidden_layers {self.num_hidden_layers}: EAGLE-3 heads may stack several "
                                  "decoder layers, other EAGLE-style heads have one")

    def variants(self) -> list[str]:
        """The variant flags this config turns on."""
        return [name for name in self.VARIANTS if getattr(self, name) not in (False, None)]

    @classmethod
    def for_target(cls, head_type: str, target: TargetConfig, feature_layers: tuple[int, ...],
                   draft_vocab_size: int | None = None, target_model: str = "", **overrides) -> DraftHeadConfig:
        """A head shaped like one layer of `target` (the usual choice), with `overrides` applied."""
        values = dict(
            head_type=head_type, hidden_size=target.hidden_size, intermediate_size=target.intermediate_size,
            num_attention_heads=target.num_attention_heads, num_key_value_heads=target.num_key_value_heads,
            head_dim=target.head_dim, vocab_size=target.vocab_size,
            draft_vocab_size=draft_vocab_size or target.vocab_size, target_hidden_size=target.hidden_size,
            target_num_layers=target.num_hidden_layers, aux_layer_ids=tuple(feature_layers),
            rms_norm_eps=target.rms_norm_eps, rope=target.rope,
            max_position_embeddings=target.max_position_embeddings, target_model=target_model)
        values.update(overrides)
        return cls(**values)

    @classmethod
    def _parse_fields(cls, data: dict[str, Any]) -> dict[str, Any]:
        return {**data, "rope": RopeConfig(**data.get("rope", {})), "aux_layer_ids": tuple(data["aux_layer_ids"])}

    def check_target(self, target: TargetConfig) -> None:
        """A head only works with the target shape it was trained for; say which value differs."""
        pairs = [("hidden size", self.target_hidden_size, target.hidden_size),
                 ("vocab size", self.vocab_size, target.vocab_size),
                 ("layer count", self.target_num_layers, target.num_hidden_layers)]
        for what, head_value, target_value in pairs:
            if head_value != target_value:
                raise DraftsmithError(f"draft head expects target {what} {head_value}, but the target has {target_value}")
        if not self.own_embedding and self.hidden_size != target.hidden_size:
            raise DraftsmithError(f"draft head hidden size {self.hidden_size} differs from the target's "
                                  f"{target.hidden_size} but the head has no embedding of its own")
        bad = [i for i in self.aux_layer_ids if not 0 <= i <= target.num_hidden_layers]
        if bad:
            raise DraftsmithError(f"aux_layer_ids {bad} out of range for a {target.num_hidden_layers}-layer target")


class AttachedHead(nn.Module):
    """Base of every head module: its native config, the target it is attached to (not a submodule: the
    target's weights are neither trained nor saved with the head) and the native save format."""

    head_type = ""

    def __init__(self, config: HeadConfig):
        super().__init__()
        self.config = config
        self._target: list = []

    def attach_target(self, target):
        self.config.check_target(target.config)
        self._target[:] = [target]
        return self

    @property
    def target(self):
        if not self._target:
            raise RuntimeError(f"{self.head_type} head has no target attached (call attach_target)")
        return self._target[0]

    def save_pretrained(self, directory: str | Path) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "config.json").write_text(json.dumps(self.config.to_json(), indent=2) + "\n")
        state = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})


class FinalHiddenHead(AttachedHead):
    """Base of heads that read only the target's final normed hidden state (Medusa, MLP speculator)."""

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return (self.target.config.num_hidden_layers,)

    def features(self, hidden_states: dict[int, torch.Tensor]) -> torch.Tensor:
        return hidden_states[self.feature_layers[0]]


class RecurrentHead(AttachedHead):
    """Base of heads that draft token by token from their own outputs through one attention layer with a
    per-slot cache (EAGLE family, MTP): one `step` used by training (with TTT history) and serving.
    `layer_shape` describes that layer (rope, head_dim, num_key_value_heads, max_position_embeddings)."""

    reads_out_through_target = False  # its logits come from the target's LM head (`readout`)

    def __init__(self, config: HeadConfig, layer_shape):
        super().__init__(config)
        self.layer_shape = layer_shape
        self.rope_cos: torch.Tensor | None = None
        self.rope_sin: torch.Tensor | None = None
        self._readout: list = []  # (the target's LM head in the head's dtype, the weight it copies)
        self._packed_readout: list = []  # (a Linear on the target's LM head weight, packed narrower; that weight)

    # -- wiring ----------------------------------------------------------------------------------------
    @property
    def feature_layers(self) -> tuple[int, ...]:
        raise NotImplementedError

    @property
    def draft_vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def sliding_window(self) -> int | None:
        """The newest this many positions the draft layer attends over (None: all)."""
        return None

    def features(self, hidden_states: dict[int, torch.Tensor]) -> torch.Tensor:
        """The target features this head reads, [B, T, F], from a target forward's hidden states."""
        return torch.cat([hidden_states[i] for i in self.feature_layers], dim=-1)

    def state_from_target(self, features: torch.Tensor) -> torch.Tensor:
        """What `step` reads as its state from target features (`from_target`): the features themselves unless
        the head maps them first (EAGLE-3's fc)."""
        return features

    def init_rope(self, max_len: int) -> None:
        device = next(self.parameters()).device
        self.rope_cos, self.rope_sin = rope_tables(self.layer_shape.rope, self.layer_shape.head_dim, max_len, device)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if self.rope_cos is None or self.rope_cos.device != positions.device:
            self.init_rope(max(self.layer_shape.max_position_embeddings, 4096))
        return self.rope_cos[positions].to(dtype), self.rope_sin[positions].to(dtype)

    @property
    def cache_layers(self) -> int:
        """Attention layers the head caches keys and values for, per slot."""
        return 1

    def make_cache(self, num_slots: int, max_len: int) -> KVCache:
        w, shape = next(self.parameters()), self.layer_shape
        return KVCache(self.cache_layers, num_slots, max_len, shape.num_key_value_heads, shape.head_dim, w.dtype, w.device)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids

    def draft_offsets(self) -> torch.Tensor | None:
        """What `to_target_ids` adds to a draft id, per draft id (EAGLE-3's d2t), or None: the same vocabulary."""
        return None

    def readout(self, x: torch.Tensor) -> torch.Tensor:
        """Logits from the target's own LM head: a bfloat16 head under a float32 target reads a bfloat16 copy,
        made once (the LM head is the largest matrix a draft step reads; not saved); otherwise x is cast to
        the LM head's dtype."""
        layer = self.readout_layer(x.dtype)
        if layer is not None:
            return layer(x)
        lm_head = self.target.lm_head
        if x.element_size() >= lm_head.weight.element_size():
            return lm_head(x.to(lm_head.weight.dtype))  # never a wider copy of a big matrix
        if not self._readout or self._readout[0].weight.dtype != x.dtype or self._readout[1] is not lm_head.weight:
            copy = Linear(lm_head.in_features, lm_head.out_features, bias=False, device="meta")
            copy.weight = nn.Parameter(lm_head.weight.detach().to(x.dtype), requires_grad=False)
            self._readout[:] = [copy, lm_head.weight]
        return self._readout[0](x)

    def readout_layer(self, dtype: torch.dtype) -> Linear | None:
        """The layer `readout` reads inputs of `dtype` out through as they are: the target's LM head, or its
        copy packed for drafts (`pack_readout`); None where readout casts them or copies the matrix."""
        lm_head = self.target.lm_head
        if self._packed_readout and self._packed_readout[1] is lm_head.weight and dtype == lm_head.weight.dtype:
            return self._packed_readout[0]
        return lm_head if dtype == lm_head.weight.dtype else None

    def pack_readout(self, dtype: torch.dtype) -> int:
        """Reads drafts' logits out through the target's LM head packed in `dtype` for the panel GEMM
        (`models.linear.pack_weights_in`): the same parameter, its own packed copy, which the target's forwards
        do not read. A head that reads out so (EAGLE-1, MTP) reads that matrix, most of its bytes, at every
        draft step; packed in bfloat16 it costs half its fp32 size more memory. -> 1 if packed, else 0."""
        lm_head = self.target.lm_head
        packed = Linear(lm_head.in_features, lm_head.out_features, bias=lm_head.bias is not None, device="meta")
        packed.weight = lm_head.weight
        if lm_head.bias is not None:
            packed.bias = lm_head.bias
        if not pack_weights_in([packed], dtype):
            return 0
        make_plans([packed])  # packed now, not in the first draft step
        self._packed_readout[:] = [packed, lm_head.weight]
        return 1

    # -- the model ---------------------------------------------------------------------------------------
    def step(self, token_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, from_target: bool,
             cache: KVCache | None = None, batch=None, ttt_history=None,
             logits_at: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """token_ids [B, T] (token t+1), hidden [B, T, F] (feature at t) -> (next hidden [B, T, H],
        logits [B, T, draft_vocab]). `from_target` says the hidden is a target feature, not a head output.
        With `logits_at` [B], logits are [B, 1, draft_vocab], at that position of each row only (a catch-up
        over several positions drafts from its last one: the LM head is most of a step's cost)."""
        raise NotImplementedError

    @staticmethod
    def _at(out: torch.Tensor, logits_at: torch.Tensor | None) -> torch.Tensor:
        """out [B, T, H] at each row's `logits_at` [B] -> [B, 1, H], or at several [B, n] -> [B, n, H]."""
        if logits_at is None:
            return out
        rows = torch.arange(out.shape[0], device=out.device)
        if logits_at.dim() == 2:
            return out[rows[:, None], logits_at]
        return out[rows, logits_at][:, None]


class DraftHead(RecurrentHead):
    """Base of EAGLE-style heads (`DraftHeadConfig`): the fused target layers, the variants, the embedding."""

    default_fc_bias = False
    variants: tuple[str, ...] = ()  # the DraftHeadConfig.VARIANTS this head computes

    def __init__(self, config: DraftHeadConfig):
        super().__init__(config, config)
        unknown = [name for name in config.variants() if name not in self.variants]
        if unknown:  # built anyway, the head would compute the plain architecture: silently wrong drafts
            raise DraftsmithError(f"{self.head_type} heads have no variant {', '.join(unknown)}")
        if config.fc_bias is None:
            config.fc_bias = self.default_fc_bias

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return self.config.aux_layer_ids

    @property
    def draft_vocab_size(self) -> int:
        return self.config.draft_vocab_size

    @property
    def sliding_window(self) -> int | None:
        return self.config.sliding_window

    @property
    def embedding_table(self) -> nn.Embedding:
        """The table draft tokens are embedded with: the head's own, or the target's."""
        return self.embed_tokens if self.config.own_embedding else self.target.model.embed_tokens

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.embedding_table(token_ids)


def load_head_weights(head: nn.Module, directory: str | Path) -> nn.Module:
    """Fills a freshly built head from `directory/model.safetensors`; every tensor must match its config."""
    weights = Path(directory) / "model.safetensors"
    if not weights.is_file():
        raise DraftsmithError(f"draft head directory {directory} has no model.safetensors")
    missing, unexpected = head.load_state_dict(load_file(str(weights)), strict=False)
    if missing or unexpected:
        raise DraftsmithError(f"{weights} does not match its config: missing {missing[:5]}, unexpected {unexpected[:5]}")
    check = getattr(head, "check_weights", None)  # a head's rules on tensor values (EAGLE-3's vocab maps)
    if check is not None:
        try:
            check()
        except DraftsmithError as exc:
            raise DraftsmithError(f"{weights}: {exc}") from None
    return head
