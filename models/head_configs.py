"""Native configs of the head types draftsmith converts but does not serve yet (MLP speculator, Medusa, MTP).

Their native directories use the same shape as EAGLE heads (`config.json` with `draftsmith_head_type`,
one `model.safetensors`), so a later serving or training issue reads what `draftsmith convert` writes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from draftsmith.errors import DraftsmithError


class _JsonConfig:
    head_type = ""

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        return {"draftsmith_head_type": self.head_type, **{k: list(v) if isinstance(v, tuple) else v for k, v in data.items()}}

    @classmethod
    def from_json(cls, data: dict[str, Any]):
        data = {k: v for k, v in data.items() if k != "draftsmith_head_type"}
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise DraftsmithError(f"{cls.head_type} config has unknown keys {sorted(unknown)}")
        return cls(**data)


@dataclass
class MLPSpeculatorConfig(_JsonConfig):
    """IBM/fms MLP speculator: n_predict stages over the target's final normed hidden state."""

    head_type = "mlp_speculator"
    emb_dim: int  # the target's hidden size
    inner_dim: int
    vocab_size: int
    n_predict: int
    tie_weights: bool = False  # all emb/head/ln share stage 0's; proj[i >= 2] shares proj[1]
    scale_input: bool = False
    top_k_tokens_per_head: list[int] = field(default_factory=lambda: [5, 4, 3])
    n_candidates: int = 5
    target_model: str = ""

    def check_target(self, hidden_size: int, vocab_size: int) -> None:
        if self.emb_dim != hidden_size:
            raise DraftsmithError(f"MLP speculator emb_dim {self.emb_dim}, but the target hidden size is {hidden_size}")
        if self.vocab_size != vocab_size:
            raise DraftsmithError(f"MLP speculator vocab size {self.vocab_size}, but the target has {vocab_size}")


@dataclass
class MedusaConfig(_JsonConfig):
    """Medusa: num_heads heads of num_layers ResBlocks (x + SiLU(Wx + b)) over the final normed hidden state,
    each with its own LM head, or the target's (`own_lm_heads` false, Medusa-2 style)."""

    head_type = "medusa"
    hidden_size: int
    vocab_size: int
    num_heads: int
    num_layers: int
    own_lm_heads: bool = True
    target_model: str = ""

    def check_target(self, hidden_size: int, vocab_size: int) -> None:
        if self.hidden_size != hidden_size:
            raise DraftsmithError(f"Medusa hidden size {self.hidden_size}, but the target hidden size is {hidden_size}")
        if self.vocab_size != vocab_size:
            raise DraftsmithError(f"Medusa vocab size {self.vocab_size}, but the target has {vocab_size}")


@dataclass
class MTPConfig(_JsonConfig):
    """Multi-token-prediction layers taken out of a target checkpoint. Per layer k: token_norm(embedding) and
    hidden_norm(previous hidden) concatenated in `concat_order`, input_proj, a decoder block of the target's
    own kind (kept under its source names, described by `source_config`), final_norm, the shared LM head."""

    head_type = "mtp"
    layout: str  # deepseek | qwen3_next | mimo: how the layers sit in the target checkpoint
    num_layers: int
    hidden_size: int
    vocab_size: int
    target_num_layers: int
    concat_order: str = "embedding_first"  # MiMo concatenates the hidden state first
    shared_input_proj: bool = False  # Qwen3-Next: one fc and norm pair serves every MTP block
    target_model: str = ""
    source_config: dict[str, Any] = field(default_factory=dict)

    def check_target(self, hidden_size: int, vocab_size: int) -> None:
        if self.hidden_size != hidden_size:
            raise DraftsmithError(f"MTP hidden size {self.hidden_size}, but the target hidden size is {hidden_size}")
        if self.vocab_size != vocab_size:
            raise DraftsmithError(f"MTP vocab size {self.vocab_size}, but the target has {vocab_size}")


CONVERT_ONLY_CONFIGS = {c.head_type: c for c in (MLPSpeculatorConfig, MedusaConfig, MTPConfig)}
