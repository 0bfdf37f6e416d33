"""EAGLE-3 heads with yuhuili's key names (`midlayer.*`, `fc`, `norm`, `lm_head`, `d2t`, `t2d`): yuhuili's own
`pytorch_model.bin`, SpecForge's `model.safetensors`, and what vLLM's and SGLang's llama_eagle3 load.
draftsmith's native EAGLE-3 layout uses the same names.

Fused target layers are kept internally as HF `hidden_states` indices (hs[k] = input of layer k). Sources
say them three ways, told apart by where they sit in the config:
- top-level `eagle_aux_hidden_state_layer_ids`: vLLM's convention, already hs indices;
- `eagle_config.eagle_aux_hidden_state_layer_ids`: SpecForge/SGLang "output of layer k", i.e. hs[k + 1];
- absent: the reference default hs[2], hs[L//2], hs[L-3], which needs the target's layer count L.

The variants current trainers write (norm placements, Qwen3-style q/k norms, a window: `DraftHeadConfig.VARIANTS`)
are read from speculators' flag names and the tensors that go with them (`_variants`); each engine's export
writes those its loader computes and refuses the rest by name (`ENGINE_VARIANTS`).
"""

from __future__ import annotations

import torch

from draftsmith.errors import DraftsmithError
from draftsmith.methods.eagle.convert import head_dtype, target_layers_from
from draftsmith.methods.eagle3 import Eagle3Method
from draftsmith.methods.eagle3.vocab import check_vocab_maps
from draftsmith.methods.formats.checkpoint import SourceCheckpoint, target_embedding
from draftsmith.methods.formats.layer_config import (
    layer_count,
    layer_fields,
    llama_layer_config,
    native_config,
    sliding_window,
    vllm_window,
)
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
from draftsmith.models.heads import DraftHeadConfig

MID = "midlayer."
MID_KEYS = [f"self_attn.{p}_proj.weight" for p in "qkvo"] + [f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")] + [
    "input_layernorm.weight", "hidden_norm.weight", "post_attention_layernorm.weight"]
MID_BIAS = [f"self_attn.{p}_proj.bias" for p in "qkv"]
# a stacked head's later layers (num_hidden_layers > 1) under `layers.i.` (vLLM's names), without the hidden norm
LATER_KEYS = [k for k in MID_KEYS if k != "hidden_norm.weight"]
QK_NORMS = ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]  # Qwen3-style draft layers
HEAD_KEYS = ["fc.weight", "norm.weight", "lm_head.weight"]
MAX_AUX = 16  # fc_norm.i names accepted, at most (EAGLE-3 fuses 3 target layers)
FC_NORMS = [f"fc_norm.{i}.weight" for i in range(MAX_AUX)]
OPTIONAL = ["fc.bias", "d2t", "t2d", "embed_tokens.weight", "input_norm.weight", "mask_hidden", *FC_NORMS]
# where vLLM looks for a parallel drafter's slot token (llm_base_proposer._init_parallel_drafting_params)
SLOT_TOKEN_KEYS = ("ptd_token_id", "pard_token", "mask_token_id")
# Flags of EAGLE-3 variants trainers write that draftsmith does not compute: read as plain EAGLE-3, these heads
# would draft as another model (SpecForge configs, e.g. configs/gemma3-27b-eagle3.json)
UNSUPPORTED_FLAGS = {"reuse_target_lm_head": "the target's LM head instead of the head's own",
                     "additional_fc": "a second fc projection"}
# older SpecForge names of the per-layer fc norms, which SGLang still maps
LEGACY_FC_NORMS = {f"aux_norm_{level}.weight": f"fc_norm.{i}.weight" for i, level in enumerate(("low", "mid", "high"))}


def known_names(layer_prefix: str, layers: int = 1) -> set[str]:
    """Every tensor name an EAGLE-3 checkpoint of `layers` decoder layers may hold, its first layer under
    `layer_prefix`."""
    required, optional = later_layer_names(layers)
    return ({layer_prefix + k for k in MID_KEYS + MID_BIAS + QK_NORMS} | set(HEAD_KEYS) | set(OPTIONAL) | set(required)
            | set(optional))


def optional_names(layer_prefix: str, layers: int = 1) -> tuple[str, ...]:
    return tuple(OPTIONAL) + tuple(layer_prefix + k for k in MID_BIAS + QK_NORMS) + later_layer_names(layers)[1]


def later_layer_names(layers: int) -> tuple[list[str], tuple[str, ...]]:
    """(required, optional) tensor names of layers 1..layers-1 of a stacked head."""
    prefixes = [f"layers.{i}." for i in range(1, layers)]
    return ([p + k for p in prefixes for k in LATER_KEYS],
            tuple(p + k for p in prefixes for k in MID_BIAS + QK_NORMS))


def source_feature_layers(config: dict, layers: int, n_aux: int) -> tuple[tuple[int, ...], str]:
    """(hs indices, where they came from)."""
    if config.get("eagle_aux_hidden_state_layer_ids"):
        return tuple(int(i) for i in config["eagle_aux_hidden_state_layer_ids"]), "top-level ids, vLLM convention (hs index)"
    nested = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if nested:
        return tuple(int(i) + 1 for i in nested), "eagle_config ids, SpecForge/SGLang convention (output of layer k = hs[k+1])"
    if n_aux != 3:
        raise DraftsmithError(f"fc reads {n_aux} target layers but the config names none (the default is 3)")
    ids = Eagle3Method.reference_feature_layers(layers)
    if len(set(ids)) < len(ids):  # what the reference code trained on there; served as is, but say so
        return ids, (f"reference default for a {layers}-layer target, which repeats a layer (draftsmith trains "
                     f"{list(Eagle3Method.default_feature_layers(layers))} there; speculators refuses repeats)")
    return ids, f"reference default for a {layers}-layer target"


def _trained_embedding(config: dict, embedding: torch.Tensor, ctx: ReadContext) -> str | None:
    """Why a checkpoint's embed_tokens is the head's own rather than a frozen copy of the target's, or None.
    speculators says (`embed_requires_grad`); for other sources the target, when known, tells: trained, it
    differs. Dropped as a copy, a trained one left the head agreeing with itself only 96/88/71% at draft steps
    1/2/3."""
    if config.get("embed_requires_grad") is not None:
        return "embed_requires_grad: true" if config["embed_requires_grad"] else None
    theirs = target_embedding(ctx.target_name, tuple(embedding.shape))
    if theirs is None:
        return None
    return None if torch.equal(theirs.to(embedding.dtype), embedding) else "it differs from the target's"


def _variants(config: dict, tensors: dict[str, torch.Tensor], n_aux: int, where: str,
              specforge_norm_output: bool) -> tuple[dict, list[str]]:
    """(DraftHeadConfig variant fields, notes) from the config's flags (speculators' names; SpecForge writes
    fc_norm and norm_output too, NVIDIA's checkpoints nest norm_before_fc in eagle_config) and the tensors that
    go with them. `specforge_norm_output`: read norm_output as SpecForge trains it (see below)."""
    nested = config.get("eagle_config") or {}
    flag = lambda name: bool(config.get(name, nested.get(name, False)))  # noqa: E731
    for name, what in UNSUPPORTED_FLAGS.items():
        if flag(name):
            raise DraftsmithError(f"{where}: {name}=true ({what}) is an EAGLE-3 variant draftsmith does not serve")
    fields = {name: flag(name) for name in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")}
    notes = []
    if specforge_norm_output:
        # SpecForge's norm_output (default true) only says whether the final norm precedes the LM head; its
        # training always feeds the pre-norm state back. speculators, vLLM and SGLang read `true` as feeding
        # the normed state back: served their way, a SpecForge head would not draft as it was trained.
        if config.get("norm_output", True) is False:
            raise DraftsmithError(f"{where}: norm_output=false (SpecForge: no final norm before the LM head) is an "
                                  "EAGLE-3 variant draftsmith does not serve")
        if "norm_output" in config:
            notes.append("norm_output=true read as SpecForge trains it: the final norm before the LM head, the "
                         "pre-norm state fed back (vLLM and SGLang would feed the normed state back)")
        fields["norm_output"] = False
    if fields["norm_before_fc"] and fields["fc_norm"]:
        raise DraftsmithError(f"{where}: norm_before_fc and fc_norm are both set, and they exclude each other")
    if fields["norm_before_fc"] and "input_norm.weight" not in tensors:
        # speculators loads such a checkpoint too, its norm left at ones
        tensors["input_norm.weight"] = torch.ones(tensors["fc.weight"].shape[1], dtype=tensors["fc.weight"].dtype)
        notes.append("norm_before_fc without input_norm.weight: the norm's weight is ones, as speculators loads it")
    if "input_norm.weight" in tensors and not fields["norm_before_fc"]:
        raise DraftsmithError(f"{where}: the checkpoint holds input_norm.weight but norm_before_fc is not set")
    fc_norms = sorted(name for name in tensors if name.startswith("fc_norm."))
    expected = FC_NORMS[:n_aux]
    if fc_norms and not fields["fc_norm"]:
        fields["fc_norm"] = True
        notes.append(f"fc_norm: the checkpoint holds {', '.join(fc_norms)} (a norm per fused layer before fc)")
    if fields["fc_norm"] and fc_norms != sorted(expected):
        raise DraftsmithError(f"{where}: fc_norm expects {', '.join(expected)} (one per fused layer), the checkpoint "
                              f"holds {', '.join(fc_norms) or 'none'}")
    qk = [MID + name for name in QK_NORMS]
    fields["qk_norm"] = all(name in tensors for name in qk)
    if not fields["qk_norm"] and (any(name in tensors for name in qk) or config.get("model_type") == "qwen3"):
        raise DraftsmithError(f"{where}: a Qwen3-style draft layer needs both {' and '.join(qk)}")
    fields["sliding_window"] = sliding_window(config)
    if specforge_norm_output and fields["sliding_window"] is not None:
        # SpecForge's Llama draft attends without a window (window_size (-1, -1)), and vLLM's and SGLang's
        # llama_eagle3 serve this layout without one: window keys here are copies of the target's config
        notes.append(f"ignored the config's sliding window ({fields['sliding_window']}): SpecForge trains this layout "
                     "with full attention, and vLLM and SGLang serve it so")
        fields["sliding_window"] = None
    on = [name for name, value in fields.items() if value not in (False, None)]
    if on:
        notes.append("EAGLE-3 variant: " + ", ".join(f"{name}={fields[name]}" if name == "sliding_window" else name
                                                     for name in on))
    return fields, notes


def normalize(tensors: dict[str, torch.Tensor], config: dict, where: str, ctx: ReadContext,
              checkpoint: SourceCheckpoint, specforge_norm_output: bool = False) -> NormalizedHead:
    """Shared tail of every EAGLE-3 reader, once tensors carry yuhuili names and `config` is Llama-style."""
    layers_in_head = layer_count(config, where)
    layer = layer_fields(config, where)
    h = layer["hidden_size"]
    fc_out, fc_in = tensors["fc.weight"].shape
    target_hidden = int(config.get("target_hidden_size") or h)
    if fc_out != h or fc_in % target_hidden:
        raise DraftsmithError(f"fc.weight has shape {(fc_out, fc_in)}; expected ({h}, n x {target_hidden}) for "
                              f"hidden size {h} and target hidden size {target_hidden}")
    n_aux = fc_in // target_hidden
    variants, variant_notes = _variants(config, tensors, n_aux, where, specforge_norm_output)
    draft_vocab = tensors["lm_head.weight"].shape[0]
    if config.get("draft_vocab_size") and int(config["draft_vocab_size"]) != draft_vocab:
        raise DraftsmithError(f"config draft_vocab_size {config['draft_vocab_size']} but lm_head.weight has {draft_vocab} rows")
    vocab = len(tensors["t2d"]) if "t2d" in tensors else int(config.get("vocab_size") or draft_vocab)
    notes = []
    if "d2t" not in tensors:
        if draft_vocab != vocab:
            raise DraftsmithError(f"no d2t, so the draft vocab must be the full target vocab, but lm_head has "
                                  f"{draft_vocab} rows and the target vocab is {vocab}")
        tensors["d2t"] = torch.zeros(draft_vocab, dtype=torch.long)
        notes.append("no d2t/t2d: draft vocab is the full target vocab (identity maps written)")
    if "t2d" not in tensors:
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[tensors["d2t"].long() + torch.arange(draft_vocab)] = True
        tensors["t2d"] = t2d
        notes.append("derived t2d from d2t")
    tensors["d2t"], tensors["t2d"] = tensors["d2t"].to(torch.long), tensors["t2d"].to(torch.bool)
    check_vocab_maps(tensors["d2t"], tensors["t2d"], vocab)
    own_embedding = False
    if "embed_tokens.weight" in tensors:
        trained = _trained_embedding(config, tensors["embed_tokens.weight"], ctx)
        if h != target_hidden:
            own_embedding = True
            notes.append(f"kept the head's own embed_tokens (hidden {h} differs from the target's {target_hidden})")
        elif trained:
            own_embedding = True
            notes.append(f"kept the head's own trained embed_tokens ({trained})")
        else:
            del tensors["embed_tokens.weight"]
            notes.append("dropped embed_tokens.weight (a copy of the target's"
                         + (")" if ctx.target_name else "; pass --target to check that it is")
                         + ", shared with it at load time)")
    layers, target_name = target_layers_from(checkpoint, ctx, "EAGLE-3 checkpoints do not record the target's "
                                             "layer count, which native heads keep to check fused layer ids")
    aux, source = source_feature_layers(config, layers, n_aux)
    if len(aux) != n_aux:
        raise DraftsmithError(f"fc reads {n_aux} target layers but {len(aux)} fused layer ids are given ({list(aux)})")
    notes.append(f"fused target layers hs{list(aux)} ({source})")
    attention_bias = all(MID + k in tensors for k in MID_BIAS)
    _check_later_layers(tensors, layers_in_head, attention_bias, variants["qk_norm"], where)
    parallel = _parallel_fields(tensors, config, fc_in, where)
    if parallel:
        notes.append(f"P-EAGLE: mask_hidden and slot token {parallel['ptd_token_id']} (serve with "
                     '"parallel_drafting": true)')
    native = native_config("eagle3", layer, vocab_size=vocab, draft_vocab_size=draft_vocab,
                           target_hidden_size=target_hidden, target_num_layers=layers, aux_layer_ids=aux,
                           target_model=target_name, fc_bias="fc.bias" in tensors, attention_bias=attention_bias,
                           own_embedding=own_embedding, num_hidden_layers=layers_in_head, **variants, **parallel)
    if layers_in_head > 1:
        notes.append(f"{layers_in_head} decoder layers (midlayer, then layers.1..{layers_in_head - 1})")
    return NormalizedHead(native, tensors, notes + variant_notes)


def _check_later_layers(tensors: dict[str, torch.Tensor], layers: int, attention_bias: bool, qk_norm: bool,
                        where: str) -> None:
    """Every later layer holds the q/k/v biases and q/k norms the first one does, and no others."""
    wanted = (MID_BIAS if attention_bias else []) + (QK_NORMS if qk_norm else [])
    for i in range(1, layers):
        prefix = f"layers.{i}."
        held = sorted(k.removeprefix(prefix) for k in tensors if k.startswith(prefix) and k.removeprefix(prefix)
                      in MID_BIAS + QK_NORMS)
        if held != sorted(wanted):
            raise DraftsmithError(f"{where}: layer {i} holds {', '.join(held) or 'no biases or q/k norms'}, the "
                                  f"first layer {', '.join(sorted(wanted)) or 'none'}: every layer must be alike")


def _parallel_fields(tensors: dict[str, torch.Tensor], config: dict, fc_in: int, where: str) -> dict:
    """A P-EAGLE head's config fields ({} for a sequential head): its `mask_hidden` (reshaped to the native
    [1, 1, F]) and the slot token under any name vLLM reads."""
    if "mask_hidden" not in tensors:
        return {}
    if tensors["mask_hidden"].numel() != fc_in:
        raise DraftsmithError(f"{where}: mask_hidden has {tensors['mask_hidden'].numel()} values; fc reads {fc_in}")
    token = next((config[k] for k in SLOT_TOKEN_KEYS if isinstance(config.get(k), int)), None)
    if token is None:
        raise DraftsmithError(f"{where}: a P-EAGLE head (mask_hidden) needs its slot token: one of "
                              f"{', '.join(SLOT_TOKEN_KEYS)}")
    tensors["mask_hidden"] = tensors["mask_hidden"].reshape(1, 1, fc_in)
    return {"parallel_drafting": True, "ptd_token_id": token}


@register_source("eagle3", "EAGLE-3 head with yuhuili key names (midlayer.*, d2t/t2d): yuhuili, SpecForge, "
                 "and the vLLM/SGLang llama_eagle3 layouts")
class YuhuiliEagle3:
    @staticmethod
    def detect(checkpoint: SourceCheckpoint) -> bool:
        c = checkpoint.config
        if "speculators_model_type" in c or "draftsmith_head_type" in c:
            return False
        return any(n.startswith(MID) for n in checkpoint.names)

    @staticmethod
    def read(checkpoint: SourceCheckpoint, ctx: ReadContext) -> NormalizedHead:
        config = checkpoint.config
        if not config:
            raise DraftsmithError(f"{checkpoint.directory} has no config.json: EAGLE-3 heads need their layer config")
        layers = layer_count(config, f"{checkpoint.directory}/config.json")
        dropped = reject_unknown(checkpoint, known_names(MID, layers) | set(LEGACY_FC_NORMS), "EAGLE-3",
                                 ("rotary_emb.inv_freq",))
        tensors = take(checkpoint, [MID + k for k in MID_KEYS] + HEAD_KEYS + later_layer_names(layers)[0],
                       optional=optional_names(MID, layers) + tuple(LEGACY_FC_NORMS))
        tensors = {LEGACY_FC_NORMS.get(name, name): value for name, value in tensors.items()}
        # midlayer checkpoints with norm flags come from SpecForge, or from draftsmith's vllm/sglang exports,
        # which mean norm_output as those engines do
        head = normalize(tensors, config, f"{checkpoint.directory}/config.json", ctx, checkpoint,
                         specforge_norm_output=PROVENANCE_KEY not in config)
        head.notes[:0] = [f"dropped {name}" for name in dropped]
        return head


def _layer_config(head: NormalizedHead, architectures: list[str]) -> dict:
    c = head.config
    config = llama_layer_config(c, architectures, head_dtype(head.tensors))
    config.update(draft_vocab_size=c["draft_vocab_size"], target_hidden_size=c["target_hidden_size"])
    if c["fc_bias"]:
        config["bias"] = True
    if c["attention_bias"]:
        config["attention_bias"] = True
    return config


# The variants each engine's llama_eagle3 computes, under speculators' flag names and tensor names: vLLM's
# (vllm-project/vllm 055e47c2) the four norm flags, and since 0.32 a window (its draft layers read
# `layer_types` and `sliding_window`, draft-relative; the CPU backend slides too); SGLang's main (not every
# release) fc_norm and norm_output. Neither serves a Qwen3-style layer from a midlayer checkpoint;
# speculators exports keep every variant.
ENGINE_VARIANTS = {"vLLM": ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output", "sliding_window"),
                   "SGLang": ("fc_norm", "norm_output")}


def _engine_variants(head: NormalizedHead, engine: str) -> tuple[dict, list[str]]:
    """(config flags, notes) for the head's variants in `engine`'s layout; a DraftsmithError for one it lacks."""
    on = [name for name in DraftHeadConfig.VARIANTS if head.config.get(name) not in (None, False)]
    missing = [name for name in on if name not in ENGINE_VARIANTS[engine]]
    if missing:
        raise DraftsmithError(f"{engine}'s llama_eagle3 does not compute {', '.join(missing)}: served there, this "
                              "head would draft as another one; --to speculators keeps every variant")
    flags = [name for name in on if name != "sliding_window"]  # a window is keys of its own (`vllm_window`)
    notes = [f"{', '.join(flags)}: older {engine} releases ignore these flags (and serve a different head); check "
             "that yours reads them"] if flags else []
    return dict.fromkeys(flags, True), notes


@register_exporter("vllm", "eagle3")
def to_vllm(head: NormalizedHead) -> Exported:
    config = _layer_config(head, ["LlamaForCausalLMEagle3"])
    flags, notes = _engine_variants(head, "vLLM")
    # vLLM reads the top-level ids as hs indices; norm_before_residual is spelled out because vLLM's
    # speculators path defaults a missing flag to true.
    config.update(eagle_aux_hidden_state_layer_ids=list(head.config["aux_layer_ids"]), norm_before_residual=False)
    config.update(flags)
    window, window_notes = vllm_window(head.config)
    config.update(window)
    notes += window_notes
    if head.config.get("parallel_drafting"):  # P-EAGLE: vLLM reads the slot token, mask_hidden by its name
        config["ptd_token_id"] = head.config["ptd_token_id"]
        notes.append('P-EAGLE: serve with {"method": "eagle3", "parallel_drafting": true}')
    config.update(provenance(head))
    tensors = dict(head.tensors)
    if head.config["draft_vocab_size"] == head.config["vocab_size"]:
        # vLLM builds no draft_id_to_target_id for a full vocabulary and refuses a d2t it has nowhere to load
        tensors.pop("d2t"), tensors.pop("t2d")
    return Exported(config, tensors, notes=notes)


@register_exporter("sglang", "eagle3")
def to_sglang(head: NormalizedHead) -> Exported:
    if head.config.get("parallel_drafting"):
        raise DraftsmithError("a P-EAGLE head drafts its slots in parallel, which SGLang's EAGLE-3 worker does not "
                              "(it would draft them one by one from its own outputs): --to vllm or speculators")
    if head.config.get("num_hidden_layers", 1) > 1:
        raise DraftsmithError(f"SGLang's llama_eagle3 builds one decoder layer; this head has "
                              f"{head.config['num_hidden_layers']}: --to vllm or speculators")
    aux = list(head.config["aux_layer_ids"])
    if min(aux) < 1:
        raise DraftsmithError(f"fused layer hs[0] (the embeddings) cannot be written in SGLang's output-of-layer ids {aux}")
    config = _layer_config(head, ["LlamaForCausalLMEagle3"])
    flags, notes = _engine_variants(head, "SGLang")
    ids = [i - 1 for i in aux]
    config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True}
    config.update(flags)
    config.update(provenance(head))
    if ids[0] != 1:
        notes.append(f"SGLang layer ids {ids} do not start at 1: SGLang releases after PR #25454 add +1 only when the "
                     "first id is 1, so check which convention your SGLang version applies")
    return Exported(config, dict(head.tensors), notes=notes)
