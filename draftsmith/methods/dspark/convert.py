"""DSpark heads: DeepSpec's layout (deepseek-ai/DeepSpec: a flat Qwen3 config with `architectures`
["Qwen3DSparkModel"], `block_size`, `mask_token_id`, `target_layer_ids`, `num_target_layers`, `markov_rank`,
`markov_head_type`, `enable_confidence_head`, `confidence_head_with_markov`; flat tensors), which vLLM's
`Qwen3DSparkForCausalLM` loads, and speculators' `dspark` (`transformer_layer_config`,
`aux_hidden_state_layer_ids`, `sample_from_anchor`, the same head keys). The tensor names are draftsmith's own
(DFlash's plus `markov_head.*` and `confidence_head.proj.*`), so only configs are mapped.

Every DSpark layout is anchor-first: block position k drafts the token after it. DeepSpec's `target_layer_ids`
index decoder layers (-1 the embedding output), one less than HF hidden_states indices, as z-lab's do."""

from __future__ import annotations

from typing import Any

from draftsmith import __version__
from draftsmith.errors import DraftsmithError
from draftsmith.methods.dflash.convert import (
    VERIFIER_COPIES,
    _last_layer_notes,
    _normalize,
    _qwen3_layer,
    _target_layers,
)
from draftsmith.methods.dflash.convert import read_speculators as read_dflash_speculators
from draftsmith.methods.dspark.head import MARKOV_HEAD_TYPES, DSparkConfig
from draftsmith.methods.eagle.convert import head_dtype
from draftsmith.methods.formats.checkpoint import SourceCheckpoint, target_embedding
from draftsmith.methods.formats.registry import (
    Exported,
    NormalizedHead,
    ReadContext,
    provenance,
    register_exporter,
    register_source,
)
from draftsmith.methods.formats.speculators import (
    _speculators_config,
    register_speculators_reader,
)

# what vLLM's CPU build 0.32 says of the method (tests/integration/test_vllm_oracle.py keeps this true)
CPU_NOTE = ("vLLM cannot serve this export on its CPU build: 0.32's CPU runner is Model Runner V1, which refuses "
            "dspark speculative decoding (DSpark runs on vLLM's GPU model runner, which loads this layout)")
MARKOV_KEYS = ("markov_head.markov_w1.weight", "markov_head.markov_w2.weight")
GATE_KEYS = ("markov_head.gate_proj.weight", "markov_head.gate_proj.bias")  # DeepSpec's gated head
CONFIDENCE_KEYS = ("confidence_head.proj.weight", "confidence_head.proj.bias")


def _head_part(config: dict[str, Any], where: str) -> tuple[type, list[str], dict[str, Any]]:
    """DSpark's own config keys of a foreign config -> (the config class, its tensors, its fields)."""
    markov_type = config.get("markov_head_type", "vanilla")
    if markov_type not in MARKOV_HEAD_TYPES:
        raise DraftsmithError(f"{where}: markov_head_type {markov_type!r}: draftsmith runs DeepSpec's "
                              f"{' and '.join(map(repr, MARKOV_HEAD_TYPES))} heads (its rnn variant is not implemented)")
    if config.get("sample_from_anchor", True) is not True:
        raise DraftsmithError(f"{where}: sample_from_anchor false: a DSpark head drafts anchor-first (read as 1+N, "
                              "every draft is one position off and almost none is accepted)")
    rank = config.get("markov_rank", 0)
    confident = config.get("enable_confidence_head", False)
    with_markov = config.get("confidence_head_with_markov", False)
    if not isinstance(rank, int) or rank < 0 or not isinstance(confident, bool) or not isinstance(with_markov, bool):
        raise DraftsmithError(f"{where}: markov_rank must be an integer >= 0, enable_confidence_head and "
                              "confidence_head_with_markov true or false")
    names = (list(MARKOV_KEYS) if rank else []) + (list(GATE_KEYS) if rank and markov_type == "gated" else []) \
        + (list(CONFIDENCE_KEYS) if confident else [])
    fields = {"markov_rank": rank, "markov_head_type": markov_type, "enable_confidence_head": confident,
              "confidence_head_with_markov": with_markov and confident}
    return DSparkConfig, names, fields


def _head_keys(c: DSparkConfig) -> dict[str, Any]:
    return {"markov_rank": c.markov_rank, "markov_head_type": c.markov_head_type,
            "enable_confidence_head": c.enable_confidence_head,
            "confidence_head_with_markov": c.confidence_head_with_markov}


@register_source("dspark", "DSpark head, DeepSpec's layout (Qwen3DSparkModel: target_layer_ids, markov_rank, "
                 "markov_head.*, confidence_head.*), as vLLM loads it")
class DeepSpecDSpark:
    @staticmethod
    def detect(checkpoint: SourceCheckpoint) -> bool:
        config = checkpoint.config
        return "speculators_model_type" not in config and "markov_rank" in config and "target_layer_ids" in config

    @staticmethod
    def read(checkpoint: SourceCheckpoint, ctx: ReadContext) -> NormalizedHead:
        config, where = checkpoint.config, f"{checkpoint.directory}/config.json"
        ids = config.get("target_layer_ids")
        if not isinstance(ids, list) or not ids or not all(isinstance(i, int) for i in ids):
            raise DraftsmithError(f"{where}: target_layer_ids must be a non-empty list of layer ids")
        layers, target = _target_layers(config, ctx, config.get("num_target_layers"))
        return _normalize(checkpoint, config, [i + 1 for i in ids], config.get("block_size"),
                          config.get("mask_token_id"), layers, target, where, ignorable=VERIFIER_COPIES,
                          sample_from_anchor=True, head=_head_part(config, where))


@register_speculators_reader("dspark")
def read_speculators(checkpoint: SourceCheckpoint, ctx: ReadContext, where: str) -> NormalizedHead:
    return read_dflash_speculators(checkpoint, ctx, where, "DSpark", _head_part(checkpoint.config, where))


@register_exporter("vllm", "dspark")
def to_deepspec(head: NormalizedHead) -> Exported:
    c = DSparkConfig.from_json(head.config)
    config = {**_qwen3_layer(c, head_dtype(head.tensors), ["Qwen3DSparkModel"]), "block_size": c.block_size,
              "mask_token_id": c.mask_token_id, "target_layer_ids": [i - 1 for i in c.aux_layer_ids],
              "num_target_layers": c.target_num_layers, **_head_keys(c), **provenance(head)}
    adaptive = ', "enable_adaptive_verification": true' if c.enable_confidence_head else ""
    if c.markov_head_type == "vanilla":
        notes = [CPU_NOTE, f'serve with {{"method": "dspark", "num_speculative_tokens": {c.max_drafts()}{adaptive}}} '
                 "on vLLM's GPU model runner"]
    else:
        notes = [f"vLLM (0.32) serves DSpark heads of markov_head_type 'vanilla' only and refuses this "
                 f"{c.markov_head_type!r} one; DeepSpec and draftsmith serve it"]
    if c.sliding_window is not None:
        notes.append(f"vLLM's dspark attends over the whole context, not the window of {c.sliding_window} positions "
                     "the head was trained and is served with here: its acceptance may differ on long contexts")
    return Exported(config, dict(head.tensors), notes=notes + _last_layer_notes(c))


@register_exporter("speculators", "dspark")
def to_speculators(head: NormalizedHead) -> Exported:
    c = DSparkConfig.from_json(head.config)
    dtype = head_dtype(head.tensors)
    config = {"architectures": ["DSparkSpeculator"], "speculators_model_type": "dspark",
              "speculators_version": f"draftsmith-{__version__}",
              "speculators_config": _speculators_config(head, "dspark", c.max_drafts()),
              "transformer_layer_config": _qwen3_layer(c, dtype, ["Qwen3ForCausalLM"], window_keys=True),
              "draft_vocab_size": c.vocab_size, "block_size": c.block_size, "target_hidden_size": c.target_hidden_size,
              "aux_hidden_state_layer_ids": list(c.aux_layer_ids), "mask_token_id": c.mask_token_id,
              "sample_from_anchor": True, **_head_keys(c), **provenance(head)}
    if c.sliding_window is not None:
        config["sliding_window_non_causal"] = True
    tensors, notes = dict(head.tensors), _last_layer_notes(c)
    embedding = target_embedding(c.target_model, (c.vocab_size, c.target_hidden_size))
    if embedding is not None:
        tensors["embed_tokens.weight"] = embedding.to(tensors["fc.weight"].dtype)
    return Exported(config, tensors, notes=notes)
