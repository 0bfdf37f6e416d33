"""DFlash heads: z-lab's layout (a flat Qwen3 config with `block_size`, `num_target_layers` and `dflash_config`
{mask_token_id, target_layer_ids}; tensors `fc`, `hidden_norm`, `layers.N.*`, `norm`), which vLLM and SGLang
load, and speculators' `dflash` (`transformer_layer_config`, `aux_hidden_state_layer_ids`, `block_size`,
`mask_token_id`, plus copies of the verifier's embedding and LM head, which draftsmith writes (the embedding)
and skips on reading). The tensor names are draftsmith's own,
so only configs are mapped.

The block layout (`DFlashConfig.sample_from_anchor`) is speculators' `sample_from_anchor`; in z-lab's layout
`dflash_config.sample_from_anchor` (vLLM's name; its `dflash` method reads only 1+N) or
`dflash_config.query_zero_predicts_next` (sgl-project/sglang#40203, open; SGLang 0.5.23 reads only 1+N).
Absent, it is 1+N.

z-lab's `target_layer_ids` index decoder layers (feature i is the output of layer i, HF `hidden_states[i +
1]`); speculators, vLLM's `aux_hidden_state_layer_ids` and draftsmith's `feature_layers` are hidden_states
indices: one more.
"""

from __future__ import annotations

import re
from typing import Any

from draftsmith import __version__
from draftsmith.errors import DraftsmithError
from draftsmith.methods.dflash.head import DFlashConfig
from draftsmith.methods.eagle.convert import head_dtype
from draftsmith.methods.formats.checkpoint import SourceCheckpoint, target_embedding
from draftsmith.methods.formats.layer_config import layer_fields, rope_keys
from draftsmith.methods.formats.registry import (
    PROVENANCE_KEY,
    Exported,
    NormalizedHead,
    ReadContext,
    provenance,
    register_exporter,
    register_source,
    reject_unknown,
    take,
)
from draftsmith.methods.formats.speculators import (
    _speculators_config,
    _with_verifier,
    register_speculators_reader,
)

LAYER_KEYS = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
              "self_attn.q_norm.weight", "self_attn.k_norm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
              "mlp.down_proj.weight", "input_layernorm.weight", "post_attention_layernorm.weight")
BIAS_KEYS = ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias")
HEAD_KEYS = ("fc.weight", "hidden_norm.weight", "norm.weight")
VERIFIER_COPIES = ("embed_tokens.weight", "lm_head.weight")  # speculators stores them; the target has them
LAYER_INDEX = re.compile(r"^layers\.(\d+)\.")


def _layer_count(names: list[str], where: str) -> int:
    indices = {int(m[1]) for n in names if (m := LAYER_INDEX.match(n))}
    if not indices or indices != set(range(max(indices) + 1)):
        raise DraftsmithError(f"{where}: DFlash layers must be numbered 0..N-1 (found {sorted(indices)})")
    return len(indices)


def _normalize(checkpoint: SourceCheckpoint, layer_config: dict[str, Any], feature_layers: list[int], block_size,
               mask_token_id, num_target_layers, target_name: str, where: str, ignorable=(),
               sample_from_anchor=False, head: tuple[type, list[str], dict[str, Any]] = (DFlashConfig, [], {}),
               window=None) -> NormalizedHead:
    """`head`: the config class of a head built on DFlash's, the tensors it adds and its config fields;
    `window`: the block's attention window (`sliding_window`), None for the whole context."""
    config_class, head_names, head_fields = head
    if window is not None and (not isinstance(window, int) or isinstance(window, bool)):
        raise DraftsmithError(f"{where}: the attention window {window!r} must be an integer")
    if not isinstance(sample_from_anchor, bool):
        raise DraftsmithError(f"{where}: sample_from_anchor {sample_from_anchor!r} must be true or false")
    if mask_token_id is None:
        raise DraftsmithError(f"{where}: no mask_token_id: a DFlash head fills its block with that token")
    if not isinstance(block_size, int) or block_size < 2:
        raise DraftsmithError(f"{where}: block_size {block_size!r} must be an integer of at least 2")
    layers = _layer_count(checkpoint.names, where)
    biased = bool(layer_config.get("attention_bias"))
    names = [f"layers.{i}.{k}" for i in range(layers) for k in LAYER_KEYS + (BIAS_KEYS if biased else ())]
    dropped = reject_unknown(checkpoint, set(names) | set(HEAD_KEYS) | set(head_names), config_class.head_type, ignorable)
    tensors = take(checkpoint, names + list(HEAD_KEYS) + head_names)
    fields = layer_fields(layer_config, where)
    fc_in = tensors["fc.weight"].shape[1]
    if fc_in % len(feature_layers):
        raise DraftsmithError(f"{where}: fc reads {fc_in} features, not a multiple of {len(feature_layers)} target layers")
    try:
        vocab, target_layers, mask = int(layer_config["vocab_size"]), int(num_target_layers), int(mask_token_id)
    except KeyError:
        raise DraftsmithError(f"{where} lacks the layer config key 'vocab_size'") from None
    except (TypeError, ValueError) as exc:
        raise DraftsmithError(f"{where}: vocab_size, the target's layer count and mask_token_id must be integers "
                              f"({exc})") from None
    config = config_class(**fields, **head_fields, num_hidden_layers=layers, vocab_size=vocab,
                          target_hidden_size=fc_in // len(feature_layers), target_num_layers=target_layers,
                          aux_layer_ids=tuple(feature_layers), block_size=block_size, mask_token_id=mask,
                          sample_from_anchor=sample_from_anchor, attention_bias=biased, target_model=target_name,
                          sliding_window=window)
    return NormalizedHead(config.to_json(), tensors, [f"dropped {n} (the target's own)" for n in dropped])


def _zlab_window(dflash: dict[str, Any], where: str) -> int | None:
    """vLLM's DFlash window keys (`dflash_config.use_swa`, `swa_window_size`): every layer windowed or none.
    Checkpoints that window some layers only (`layer_types`) are refused in `_layer_window`."""
    if not dflash.get("use_swa"):
        return None
    if dflash.get("swa_window_size") is None:
        raise DraftsmithError(f"{where}: dflash_config.use_swa without swa_window_size")
    return dflash["swa_window_size"]


def _layer_window(layer_config: dict[str, Any], where: str) -> int | None:
    """A Qwen3 layer config's window: `sliding_window` where `use_sliding_window` or every `layer_types` entry
    says so; draftsmith windows all of a block's layers alike, so a mix is refused."""
    types = layer_config.get("layer_types") or []
    sliding = [t == "sliding_attention" for t in types]
    if any(sliding) and not all(sliding):
        raise DraftsmithError(f"{where}: layer_types windows some DFlash layers only; draftsmith's block windows "
                              "all of them or none")
    if not (all(sliding) and sliding) and not layer_config.get("use_sliding_window"):
        return None
    if layer_config.get("sliding_window") is None:
        raise DraftsmithError(f"{where}: sliding attention without a sliding_window")
    return layer_config["sliding_window"]


def _target_layers(config: dict, ctx: ReadContext, given) -> tuple[int, str]:
    mark = config.get(PROVENANCE_KEY) or {}
    if given:
        return given, mark.get("target_model", "") or ctx.target_name  # checked an integer in _normalize
    if mark.get("target_num_layers"):
        return int(mark["target_num_layers"]), mark.get("target_model", "")
    return ctx.target_layers("the checkpoint does not say how many layers its target has"), ctx.target_name


@register_source("dflash", "DFlash head, z-lab layout (dflash_config, fc/hidden_norm/layers.N.*), as vLLM loads it")
class ZLabDFlash:
    @staticmethod
    def detect(checkpoint: SourceCheckpoint) -> bool:
        return isinstance(checkpoint.config.get("dflash_config"), dict) and "speculators_model_type" not in checkpoint.config

    @staticmethod
    def read(checkpoint: SourceCheckpoint, ctx: ReadContext) -> NormalizedHead:
        config, where = checkpoint.config, f"{checkpoint.directory}/config.json"
        dflash = config["dflash_config"]
        ids = dflash.get("target_layer_ids")
        if not isinstance(ids, list) or not ids or not all(isinstance(i, int) for i in ids):
            raise DraftsmithError(f"{where}: dflash_config.target_layer_ids must be a non-empty list of layer ids")
        layers, target = _target_layers(config, ctx, config.get("num_target_layers"))
        mask = dflash.get("mask_token_id", config.get("mask_token_id"))
        block = dflash.get("block_size", config.get("block_size"))
        anchor_first = dflash.get("sample_from_anchor", dflash.get("query_zero_predicts_next", False))
        window = _zlab_window(dflash, where)
        if window is None:
            window = _layer_window(config, where)
            if window is not None and dflash.get("causal") is not False:
                raise DraftsmithError(f"{where}: sliding layers, which vLLM runs causal within the block; "
                                      "draftsmith's DFlash block is not (a non-causal window is dflash_config.use_swa)")
        return _normalize(checkpoint, config, [i + 1 for i in ids], block, mask, layers, target, where,
                          sample_from_anchor=anchor_first, window=window)


@register_speculators_reader("dflash")
def read_speculators(checkpoint: SourceCheckpoint, ctx: ReadContext, where: str, name: str = "DFlash",
                     head: tuple | None = None) -> NormalizedHead:
    """A speculators DFlash checkpoint, or with `head` (`_normalize`'s: a head drafting anchor-first, with
    parts of its own) one of a method built on DFlash's block (DSpark, named `name` in errors)."""
    config = checkpoint.config
    layer = config.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise DraftsmithError(f"{where}: transformer_layer_config must be an object")
    if config.get("draft_vocab_size") not in (None, layer.get("vocab_size")):
        raise DraftsmithError(f"{where}: draft_vocab_size {config['draft_vocab_size']} of {layer.get('vocab_size')}: "
                              f"draftsmith's {name} head reads out with the target's whole LM head")
    ids = config.get("aux_hidden_state_layer_ids")
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) for i in ids):
        raise DraftsmithError(f"{where}: aux_hidden_state_layer_ids must be a non-empty list of layer ids")
    ctx = _with_verifier(ctx, config, checkpoint.directory)
    layers, target = _target_layers(config, ctx, None)
    window = _layer_window(layer, where)
    if window is not None and not config.get("sliding_window_non_causal"):
        raise DraftsmithError(f"{where}: windowed layers without sliding_window_non_causal attend causally within "
                              "the block, which draftsmith's DFlash block does not")
    return _normalize(checkpoint, layer, ids, config.get("block_size"), config.get("mask_token_id"), layers, target,
                      where, ignorable=VERIFIER_COPIES + ("d2t", "t2d", "verifier_"),
                      sample_from_anchor=head is not None or config.get("sample_from_anchor", False),
                      head=head if head is not None else (DFlashConfig, [], {}), window=window)


def _qwen3_layer(c: DFlashConfig, dtype: str, architectures: list[str], window_keys: bool = False) -> dict[str, Any]:
    """The Qwen3 config of the block's layers; `window_keys`: the window as HF's per-layer keys (speculators'
    reading; vLLM takes a layer_types window as causal, so z-lab's layout keeps it in dflash_config)."""
    return {"architectures": architectures, "model_type": "qwen3", "hidden_size": c.hidden_size,
            "intermediate_size": c.intermediate_size, "num_hidden_layers": c.num_hidden_layers,
            "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
            "head_dim": c.head_dim, "hidden_act": "silu", "rms_norm_eps": c.rms_norm_eps, "vocab_size": c.vocab_size,
            "max_position_embeddings": c.max_position_embeddings, **rope_keys(c.rope), "attention_bias": c.attention_bias,
            "tie_word_embeddings": False, "use_sliding_window": False, "torch_dtype": dtype,
            **(_window_keys(c) if window_keys else {})}


def _window_keys(c: DFlashConfig) -> dict[str, Any]:
    """HF's per-layer window keys of the block's layers (speculators reads them): every layer windowed, or none."""
    if c.sliding_window is None:
        return {}
    return {"sliding_window": c.sliding_window, "layer_types": ["sliding_attention"] * c.num_hidden_layers}


def _last_layer_notes(c: DFlashConfig) -> list[str]:
    """Where the head reads the target's last layer: draftsmith (as HF's hidden_states) takes it after the
    final norm, vLLM and SGLang before it, and no key of these layouts says which."""
    if c.target_num_layers not in c.aux_layer_ids:
        return []
    return [f"the head reads the target's last layer ({c.target_num_layers}), which draftsmith trains on after the "
            "final norm and vLLM and SGLang capture before it: their acceptance may differ a little (the demo "
            "head: within 0.03 per position in vLLM)"]


def _layout_notes(c: DFlashConfig) -> list[str]:
    """What serves an anchor-first head: not vLLM's dflash method, which reads only the 1+N layout."""
    if not c.sample_from_anchor:
        return []
    return ["vLLM cannot serve this export: the head drafts anchor-first (sample_from_anchor), and vLLM's dflash "
            "method reads only the 1+N block layout (its GPU runner refuses the key; its CPU build 0.32 ignores it "
            "and reads every draft one position off). Nor can SGLang 0.5.23: its DFlash worker reads drafts from "
            "block positions 1.. (sgl-project/sglang#40203, open, adds dflash_config.query_zero_predicts_next, "
            "written here). draftsmith serve reads either layout; for vLLM, train with model.sample_from_anchor "
            "false"]


@register_exporter("vllm", "dflash")
@register_exporter("sglang", "dflash")
def to_zlab(head: NormalizedHead) -> Exported:
    c = DFlashConfig.from_json(head.config)
    if 0 in c.aux_layer_ids:
        raise DraftsmithError("the head reads the target's embedding output (hidden_states index 0), which z-lab's "
                              "target_layer_ids (decoder-layer outputs) cannot name")
    dflash = {"mask_token_id": c.mask_token_id, "target_layer_ids": [i - 1 for i in c.aux_layer_ids]}
    if c.sliding_window is not None:  # vLLM's keys of a windowed, non-causal DFlash block (`qwen3_dflash.py`)
        dflash.update(use_swa=True, swa_window_size=c.sliding_window, causal=False)
    notes = _layout_notes(c) or [f'serve with {{"method": "dflash", "num_speculative_tokens": {c.max_drafts()}}}']
    if c.sample_from_anchor:
        dflash.update(sample_from_anchor=True, query_zero_predicts_next=True)
    config = {**_qwen3_layer(c, head_dtype(head.tensors), ["DFlashDraftModel"]),
              "auto_map": {"AutoModel": "dflash.DFlashDraftModel"}, "block_size": c.block_size,
              "num_target_layers": c.target_num_layers, "dflash_config": dflash, **provenance(head)}
    return Exported(config, dict(head.tensors), notes=[*notes, *_last_layer_notes(c)])


@register_exporter("speculators", "dflash")
def to_speculators(head: NormalizedHead) -> Exported:
    c = DFlashConfig.from_json(head.config)
    dtype = head_dtype(head.tensors)
    config = {"architectures": ["DFlashSpeculator"], "speculators_model_type": "dflash",
              "speculators_version": f"draftsmith-{__version__}",
              "speculators_config": _speculators_config(head, "dflash", c.max_drafts()),
              "transformer_layer_config": _qwen3_layer(c, dtype, ["Qwen3ForCausalLM"], window_keys=True),
              "draft_vocab_size": c.vocab_size, "block_size": c.block_size, "target_hidden_size": c.target_hidden_size,
              "aux_hidden_state_layer_ids": list(c.aux_layer_ids), "mask_token_id": c.mask_token_id,
              "sample_from_anchor": c.sample_from_anchor, **provenance(head)}
    if c.sliding_window is not None:
        config["sliding_window_non_causal"] = True  # the windowed block sees all of itself, as DFlash's does
    tensors, notes = dict(head.tensors), _layout_notes(c) + _last_layer_notes(c)
    embedding = target_embedding(c.target_model, (c.vocab_size, c.target_hidden_size))
    if embedding is None:
        notes.append("embed_tokens.weight not written (the target is not a model directory here): speculators "
                     "stores a copy of the verifier's, which vLLM does not need")
    else:
        tensors["embed_tokens.weight"] = embedding.to(tensors["fc.weight"].dtype)
    return Exported(config, tensors, notes=notes)
