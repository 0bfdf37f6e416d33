"""Native head configs: one `HeadConfig` base whose `draftsmith_head_type` key is the discriminator, and the
configs of the heads that are not EAGLE-style (MLP speculator, Medusa, MTP).

Every native head directory has the same shape (`config.json` with `draftsmith_head_type`, one
`model.safetensors`); which subclass reads a config.json is decided by the method registry
(`draftsmith.methods.read_head_config`), never by a table kept here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

from draftsmith.errors import DraftsmithError
from draftsmith.models.config import TargetConfig

HEAD_TYPE_KEY = "draftsmith_head_type"


class HeadConfig:
    """Base of native head configs (dataclasses). `head_type` is the discriminator written to config.json;
    a subclass serving several head types (the EAGLE family) declares it as a dataclass field instead."""

    # no value here: the EAGLE family's dataclass field of the same name must not inherit it as a default
    head_type: ClassVar[str]

    def to_json(self) -> dict[str, Any]:
        data = {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}
        data.pop("head_type", None)
        return {HEAD_TYPE_KEY: self.head_type, **data}

    @classmethod
    def from_json(cls, data: dict[str, Any]):
        data = dict(data)
        head_type = data.pop(HEAD_TYPE_KEY, None)
        names = {f.name for f in dataclasses.fields(cls)}
        if "head_type" in names:
            data["head_type"] = head_type
        elif head_type not in (None, cls.head_type):
            raise DraftsmithError(f"{cls.__name__} reads {cls.head_type!r} heads, not {head_type!r}")
        unknown = set(data) - names
        if unknown:
            raise DraftsmithError(f"{head_type or cls.head_type} head config has unknown keys {sorted(unknown)}")
        try:
            return cls(**cls._parse_fields(data))
        except TypeError as exc:  # a missing required key
            raise DraftsmithError(f"{head_type or cls.head_type} head config: {exc}") from None

    @classmethod
    def _parse_fields(cls, data: dict[str, Any]) -> dict[str, Any]:
        """Turns JSON values into field types (nested dataclasses, tuples); plain by default."""
        return data

    def check_target(self, target: TargetConfig) -> None:
        """Raises a DraftsmithError naming both values when the head does not fit `target`."""
        raise NotImplementedError

    def max_drafts(self) -> int | None:
        """The most tokens the head drafts per step (a head or stage each), or None where it has no limit."""
        return None


def check_sizes(what: str, hidden: int, vocab: int, target: TargetConfig) -> None:
    if hidden != target.hidden_size:
        raise DraftsmithError(f"{what} hidden size {hidden}, but the target hidden size is {target.hidden_size}")
    if vocab != target.vocab_size:
        raise DraftsmithError(f"{what} vocab size {vocab}, but the target has {target.vocab_size}")


@dataclass
class MLPSpeculatorConfig(HeadConfig):
    """IBM/fms MLP speculator: n_predict stages over the target's final normed hidden state."""

    head_type: ClassVar[str] = "mlp_speculator"
    emb_dim: int  # the target's hidden size
    inner_dim: int
    vocab_size: int
    n_predict: int
    tie_weights: bool = False  # all emb/head/ln share stage 0's; proj[i >= 2] shares proj[1]
    scale_input: bool = False
    top_k_tokens_per_head: list[int] = field(default_factory=lambda: [5, 4, 3])
    n_candidates: int = 5
    target_model: str = ""

    def check_target(self, target: TargetConfig) -> None:
        check_sizes("MLP speculator", self.emb_dim, self.vocab_size, target)

    def max_drafts(self) -> int:
        return self.n_predict  # one per stage


@dataclass
class MedusaConfig(HeadConfig):
    """Medusa: num_heads heads of num_layers ResBlocks (x + SiLU(Wx + b)) over the final normed hidden state,
    each with its own LM head, or the target's (`own_lm_heads` false, Medusa-2 style)."""

    head_type: ClassVar[str] = "medusa"
    hidden_size: int
    vocab_size: int
    num_heads: int
    num_layers: int
    own_lm_heads: bool = True
    target_model: str = ""

    def check_target(self, target: TargetConfig) -> None:
        check_sizes("Medusa", self.hidden_size, self.vocab_size, target)

    def max_drafts(self) -> int:
        return self.num_heads  # one per head


# MTP blocks of these model types are a family the runtime runs (MiMo's is a Qwen2 decoder layer)
BLOCK_FAMILIES = {"mimo": "qwen2"}


@dataclass
class MTPConfig(HeadConfig):
    """Multi-token-prediction layers: taken out of a target checkpoint, or trained by draftsmith for a target
    that has none. Per layer k: token_norm(embedding) and hidden_norm(previous hidden) concatenated in
    `concat_order`, input_proj, a decoder block of the target's own kind (kept under its source names,
    described by `source_config`), final_norm, the shared LM head."""

    head_type: ClassVar[str] = "mtp"
    layout: str  # deepseek | qwen3_next | mimo: how the layers sit in the target checkpoint
    num_layers: int
    hidden_size: int
    vocab_size: int
    target_num_layers: int
    concat_order: str = "embedding_first"  # MiMo concatenates the hidden state first
    shared_input_proj: bool = False  # Qwen3-Next: one fc and norm pair serves every MTP block
    target_model: str = ""
    source_config: dict[str, Any] = field(default_factory=dict)

    def check_target(self, target: TargetConfig) -> None:
        check_sizes("MTP", self.hidden_size, self.vocab_size, target)

    @property
    def feeds_back_normed(self) -> bool:
        """MiMo's layer returns its final_norm output, which the next step reads (vLLM mimo_mtp.py); DeepSeek's
        returns the block output and norms it for the LM head only (deepseek_mtp.py)."""
        return self.layout == "mimo"

    def block_config(self) -> TargetConfig:
        """The decoder block's architecture, as the runtime's config of a target of that kind; a
        DraftsmithError naming the model type where the block is not one the runtime runs (MLA, MoE)."""
        from draftsmith.errors import UnsupportedModelError

        model_type = self.source_config.get("model_type")
        config = {**self.source_config, "model_type": BLOCK_FAMILIES.get(model_type, model_type)}
        try:
            block = TargetConfig.from_hf_dict(config)
        except (UnsupportedModelError, DraftsmithError) as exc:
            raise DraftsmithError(f"MTP layers of a {model_type!r} model cannot be served by draftsmith: its decoder "
                                  f"block is not one the runtime runs ({exc}); `draftsmith convert --to vllm` "
                                  "writes them for vLLM") from None
        if block.o_bias or block.mlp_bias:
            raise DraftsmithError(f"MTP block of a {model_type!r} model has output-projection or MLP biases, which "
                                  "draftsmith's draft layer lacks")
        return block
