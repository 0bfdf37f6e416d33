"""vllm-project/speculators checkpoints: EAGLE-3 (`layers.0.*` names, a nested
`transformer_layer_config`, ids in vLLM's hs convention) and the legacy EAGLE type (`fusion_fc`,
`transformer.*`), which vLLM detects by `speculators_model_type` and serves with the verifier it names.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from draftsmith import __version__
from draftsmith.errors import DraftsmithError
from draftsmith.methods.eagle import convert as eagle
from draftsmith.methods.eagle3 import convert as eagle3
from draftsmith.methods.formats.checkpoint import SourceCheckpoint, local_directory, target_embedding
from draftsmith.methods.formats.layer_config import llama_layer_config
from draftsmith.methods.formats.registry import (
    Exported,
    NormalizedHead,
    ReadContext,
    provenance,
    register_exporter,
    register_source,
    reject_unknown,
    take,
)
from draftsmith.models.config import TargetConfig

LAYER = "layers.0."
LEGACY_LAYER = "transformer."
IGNORABLE = ("embed_tokens.weight", "verifier_lm_head.weight", "verifier_norm.weight", "rotary_emb.inv_freq")
LAYER_FLAGS = ("draft_vocab_size", "target_hidden_size", "eagle_aux_hidden_state_layer_ids", "norm_before_residual",
               "norm_before_fc", "fc_norm", "norm_output", "embed_requires_grad")


def _layer_config(config: dict[str, Any], where: str) -> dict[str, Any]:
    layer = config.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise DraftsmithError(f"{where}: transformer_layer_config must be an object")
    return dict(layer)


def _read_eagle3(checkpoint: SourceCheckpoint, ctx: ReadContext, where: str) -> NormalizedHead:
    """EAGLE-3, and P-EAGLE (`peagle`: the same with `mask_hidden` and `mask_token_id`)."""
    config = checkpoint.config
    layer_config = _layer_config(config, where)
    for key in LAYER_FLAGS + ("mask_token_id",):
        if config.get(key) is not None:
            layer_config[key] = config[key]
    layers = eagle3.layer_count(layer_config, where)
    dropped = reject_unknown(checkpoint, eagle3.known_names(LAYER, layers), "speculators EAGLE-3", IGNORABLE)
    raw = take(checkpoint, [LAYER + k for k in eagle3.MID_KEYS] + eagle3.HEAD_KEYS + eagle3.later_layer_names(layers)[0],
               optional=eagle3.optional_names(LAYER, layers))
    tensors = {eagle3.MID + k.removeprefix(LAYER) if k.startswith(LAYER) else k: v for k, v in raw.items()}
    head = eagle3.normalize(tensors, layer_config, where, _with_verifier(ctx, config, checkpoint.directory), checkpoint)
    head.notes[:0] = [f"dropped {name}" for name in dropped]
    return head


def _read_legacy_eagle(checkpoint: SourceCheckpoint, ctx: ReadContext, where: str) -> NormalizedHead:
    config = checkpoint.config
    if config.get("layernorms"):
        raise DraftsmithError(f"{where}: layernorms=true (HASS-style extra norms) is an EAGLE variant draftsmith does "
                              "not serve")
    layer_config = _layer_config(config, where)
    mapping = {"fusion_fc.weight": "fc.weight", "fusion_fc.bias": "fc.bias"}
    mapping.update({LEGACY_LAYER + k.removeprefix(eagle.LAYER): k for k in eagle.LAYER_KEYS + eagle.BIAS_KEYS})
    dropped = reject_unknown(checkpoint, set(mapping), "speculators EAGLE", IGNORABLE)
    required = [k for k, v in mapping.items() if v in ["fc.weight", *eagle.LAYER_KEYS]]
    raw = take(checkpoint, required, optional=tuple(k for k in mapping if k not in required))
    tensors = {mapping[k]: v for k, v in raw.items()}
    if bool(config.get("fusion_bias")) != ("fc.bias" in tensors):
        raise DraftsmithError(f"{where}: fusion_bias={config.get('fusion_bias')} but fusion_fc.bias is "
                              f"{'present' if 'fc.bias' in tensors else 'absent'}")
    # Reuse the yuhuili reader's shape checks on a view with yuhuili names.
    view = _Renamed(checkpoint, tensors, layer_config)
    head = eagle.YuhuiliEagle.read(view, _with_verifier(ctx, config, checkpoint.directory))
    head.notes[:0] = [f"dropped {name}" for name in dropped]
    return head


class _Renamed:
    """A SourceCheckpoint look-alike over already-read, renamed tensors."""

    def __init__(self, base: SourceCheckpoint, tensors: dict, config: dict):
        self.path, self.directory, self.config, self._tensors = base.path, base.directory, config, tensors
        mark = base.config.get("draftsmith")
        if mark:
            self.config = {**config, "draftsmith": mark}

    @property
    def names(self):
        return list(self._tensors)

    def has(self, name):
        return name in self._tensors

    def shape(self, name):
        return tuple(self._tensors[name].shape)

    def read(self, names):
        return {n: self._tensors[n] for n in names}


def _with_verifier(ctx: ReadContext, config: dict, source_dir: Path) -> ReadContext:
    """The target: --target's, else the verifier the config names where that is a model directory here (as
    is, or relative to the checkpoint), which gives what the head needs of it (its layer count) without
    --target. A hub name is never downloaded: the reader then asks for --target."""
    verifier = ((config.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path", "")
    if ctx.target is not None or not verifier:
        return ReadContext(ctx.target, ctx.target_name or verifier)
    found = local_directory(verifier, source_dir, holding="config.json")
    if found is None:
        return ReadContext(None, verifier)
    return ReadContext(TargetConfig.from_model_dir(found), str(found))


_READERS = {"eagle3": _read_eagle3, "peagle": _read_eagle3, "eagle": _read_legacy_eagle}


def register_speculators_reader(kind: str):
    """For a method's own converter module: reads checkpoints of `speculators_model_type` `kind`."""
    def decorate(read):
        _READERS[kind] = read
        return read

    return decorate


@register_source("speculators", "vllm-project/speculators checkpoint (speculators_model_type eagle3, dflash, or legacy "
                 "eagle)")
class Speculators:
    @staticmethod
    def detect(checkpoint: SourceCheckpoint) -> bool:
        return "speculators_model_type" in checkpoint.config

    @staticmethod
    def read(checkpoint: SourceCheckpoint, ctx: ReadContext) -> NormalizedHead:
        kind = checkpoint.config.get("speculators_model_type")
        if kind not in _READERS:
            raise DraftsmithError(f"speculators_model_type {kind!r} is not one draftsmith converts ({', '.join(_READERS)})")
        return _READERS[kind](checkpoint, ctx, f"{checkpoint.directory}/config.json")


def _verifier(head: NormalizedHead) -> dict[str, Any]:
    name = head.config.get("target_model", "")
    architectures = ["LlamaForCausalLM"]
    path = Path(name) / "config.json" if name else None
    if path is not None and path.is_file():
        architectures = json.loads(path.read_text()).get("architectures") or architectures
    return {"name_or_path": name, "architectures": architectures}


def _speculators_config(head: NormalizedHead, algorithm: str, tokens: int) -> dict[str, Any]:
    return {"algorithm": algorithm,
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": tokens, "verifier_accept_k": 1,
                                  "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy", "verifier": _verifier(head)}


@register_exporter("speculators", "eagle3")
def to_speculators_eagle3(head: NormalizedHead) -> Exported:
    c = head.config
    if c["fc_bias"]:
        raise DraftsmithError("the speculators EAGLE-3 layout has no fc bias")
    if c["own_embedding"] and c["hidden_size"] != c["target_hidden_size"]:
        raise DraftsmithError("the speculators EAGLE-3 layout has no draft narrower than the target (own embedding "
                              f"of hidden {c['hidden_size']}, target {c['target_hidden_size']})")
    ids = list(c["aux_layer_ids"])
    if len(set(ids)) < len(ids):
        raise DraftsmithError(f"the head fuses target layers {ids}, repeating one, which speculators refuses; "
                              "a head trained with distinct layers (the default now) exports")
    # speculators builds Llama and Qwen3 draft layers; a Qwen3 one is a Llama one with q/k norms
    layer = llama_layer_config(c, ["Qwen3ForCausalLM" if c["qk_norm"] else "LlamaForCausalLM"],
                               eagle.head_dtype(head.tensors), "qwen3" if c["qk_norm"] else "llama")
    if c["attention_bias"]:
        layer["attention_bias"] = True
    window = c["sliding_window"]
    if window is not None or c["qk_norm"]:  # Qwen3Config slides from a default layer on unless told
        layer.update(layer_types=["sliding_attention" if window else "full_attention"] * layer["num_hidden_layers"],
                     use_sliding_window=window is not None, sliding_window=window)
    kind = "peagle" if c.get("parallel_drafting") else "eagle3"  # P-EAGLE: speculators' own type
    config = {"architectures": ["PEagleSpeculator" if kind == "peagle" else "Eagle3Speculator"],
              "speculators_model_type": kind, "speculators_version": f"draftsmith-{__version__}",
              "speculators_config": _speculators_config(head, kind, 3), "transformer_layer_config": layer,
              "draft_vocab_size": c["draft_vocab_size"],
              "target_hidden_size": c["target_hidden_size"] if c["target_hidden_size"] != c["hidden_size"] else None,
              "eagle_aux_hidden_state_layer_ids": list(c["aux_layer_ids"]),
              **{flag: bool(c[flag]) for flag in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")},
              "embed_requires_grad": bool(c["own_embedding"]), **provenance(head)}
    if kind == "peagle":
        config["mask_token_id"] = c["ptd_token_id"]
    tensors = {LAYER + k.removeprefix(eagle3.MID) if k.startswith(eagle3.MID) else k: v for k, v in head.tensors.items()}
    if c["draft_vocab_size"] == c["vocab_size"]:  # speculators writes the maps only for a reduced vocab
        tensors.pop("d2t"), tensors.pop("t2d")
    notes = []
    if "embed_tokens.weight" not in tensors:
        # speculators' own checkpoints carry the verifier's embedding; from one without it, speculators 0.9
        # (transformers 5.23) builds a zero embedding rather than the verifier's
        embedding = target_embedding(c.get("target_model", ""), (c["vocab_size"], c["target_hidden_size"]))
        if embedding is None:
            notes.append("embed_tokens.weight not written (no input embedding of the head's shape found in the "
                         "target, or the target is not a model directory here: pass --target): speculators 0.9 "
                         "loads such a checkpoint with a zero embedding")
        else:
            tensors["embed_tokens.weight"] = embedding.to(tensors["fc.weight"].dtype)
    return Exported(config, tensors, notes=notes)


@register_exporter("speculators", "eagle")
def to_speculators_eagle(head: NormalizedHead) -> Exported:
    c = head.config
    eagle.refuse_window(head, "the legacy speculators EAGLE layout")
    layer = llama_layer_config(c, ["LlamaForCausalLM"], eagle.head_dtype(head.tensors), "qwen2" if c["attention_bias"] else "llama")
    config = {"architectures": ["EagleSpeculator", "LlamaDecoderLayer"], "speculators_model_type": "eagle",
              "speculators_version": f"draftsmith-{__version__}",
              "speculators_config": _speculators_config(head, "eagle", 5),
              "transformer_layer_architecture": "LlamaDecoderLayer", "transformer_layer_config": layer,
              "layernorms": False, "fusion_bias": bool(c["fc_bias"]), **provenance(head)}
    renamed = {"fc.weight": "fusion_fc.weight", "fc.bias": "fusion_fc.bias"}
    tensors = {renamed.get(k, LEGACY_LAYER + k.removeprefix(eagle.LAYER)): v for k, v in head.tensors.items()}
    return Exported(config, tensors, notes=["the legacy speculators EAGLE type was removed in speculators PR #672; "
                                            "current vLLM loads the yuhuili layout (--to vllm) instead"])
