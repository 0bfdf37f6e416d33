"""EAGLE-1/2 heads in the yuhuili layout, which current vLLM and SGLang load as they
are, and draftsmith's native layout, which keeps yuhuili's key names.

Read: `pytorch_model.bin` or safetensors; `fc.bias` and Qwen2's q/k/v biases decided from the keys (the
config's `bias` flag is known to disagree with some files); the frozen copy of the target's embedding
(and the target LM head a vLLM-V0 conversion added) dropped, since the head shares the target's; the
vLLM-V0 wrapper config `{"model_type": "eagle", "model": {...}}` unwrapped; a sliding window read as
transformers builds the layer (`layer_types`, or Qwen2's `use_sliding_window`).

Written: a windowed head for vLLM as `layer_types` and `sliding_window`, with `target_layer_count` (vLLM's EAGLE-1
numbers its draft layer after the target's, and reads `layer_types` at that number less this count);
SGLang's EAGLE-1 and the legacy speculators layout have no window, so a windowed head is refused there.
"""

from __future__ import annotations

from draftsmith.errors import DraftsmithError
from draftsmith.methods.formats.checkpoint import SourceCheckpoint
from draftsmith.methods.formats.layer_config import (
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

LAYER = "layers.0."
LAYER_KEYS = [f"{LAYER}self_attn.{p}_proj.weight" for p in "qkvo"] + [
    f"{LAYER}mlp.{p}_proj.weight" for p in ("gate", "up", "down")] + [f"{LAYER}post_attention_layernorm.weight"]
BIAS_KEYS = [f"{LAYER}self_attn.{p}_proj.bias" for p in "qkv"]
# Frozen copies shared with the target, and rotary caches: never part of the head.
IGNORABLE = ("embed_tokens.weight", "lm_head.weight", "rotary_emb.inv_freq")


def head_dtype(tensors) -> str:
    return str(tensors["fc.weight"].dtype).removeprefix("torch.")


def target_layers_from(checkpoint: SourceCheckpoint, ctx: ReadContext, why: str) -> tuple[int, str]:
    """(target layer count, target name): from a draftsmith export's provenance block, else from --target."""
    mark = checkpoint.config.get(PROVENANCE_KEY) or {}
    if mark.get("target_num_layers"):
        return int(mark["target_num_layers"]), mark.get("target_model", "")
    return ctx.target_layers(why), ctx.target_name


@register_source("eagle", "EAGLE-1/2 head, yuhuili layout (fc over [embedding; hidden], layers.0.*, no norm/lm_head)")
class YuhuiliEagle:
    @staticmethod
    def detect(checkpoint: SourceCheckpoint) -> bool:
        c = checkpoint.config
        if "speculators_model_type" in c or "draftsmith_head_type" in c:
            return False
        prefix = "model." if checkpoint.has("model." + LAYER_KEYS[0]) else ""
        return (checkpoint.has(prefix + "fc.weight") and checkpoint.has(prefix + LAYER_KEYS[0])
                and not any(n.startswith("midlayer.") or "hidden_norm" in n for n in checkpoint.names))

    @staticmethod
    def read(checkpoint: SourceCheckpoint, ctx: ReadContext) -> NormalizedHead:
        config = checkpoint.config
        if config.get("model_type") == "eagle" and isinstance(config.get("model"), dict):
            config = config["model"]  # vLLM V0 wrapper
        if not config:
            raise DraftsmithError(f"{checkpoint.directory} has no config.json: EAGLE heads need their Llama-style layer config")
        # A vLLM-V0 conversion prefixed layer keys with `model.`; strip it back.
        prefix = "model." if checkpoint.has("model." + LAYER_KEYS[0]) else ""
        dropped = reject_unknown(checkpoint, {prefix + k for k in ["fc.weight", "fc.bias", *LAYER_KEYS, *BIAS_KEYS]},
                                 "EAGLE-1", IGNORABLE)
        raw = take(checkpoint, [prefix + k for k in ["fc.weight", *LAYER_KEYS]],
                   optional=tuple(prefix + k for k in ["fc.bias", *BIAS_KEYS]))
        tensors = {k.removeprefix(prefix): v for k, v in raw.items()}
        layer = layer_fields(config, f"{checkpoint.directory}/config.json")
        h = layer["hidden_size"]
        if tuple(tensors["fc.weight"].shape) != (h, 2 * h):
            raise DraftsmithError(f"fc.weight has shape {tuple(tensors['fc.weight'].shape)}, expected ({h}, {2 * h}) "
                                  f"for hidden size {h}")
        attention_bias = all(k in tensors for k in BIAS_KEYS)
        if not attention_bias and any(k in tensors for k in BIAS_KEYS):
            raise DraftsmithError("only some of the q/k/v projections have a bias; expected all or none")
        layers, target_name = target_layers_from(
            checkpoint, ctx, "yuhuili EAGLE checkpoints do not record the target's layer count, which fixes the "
            "feature they read (its final normed hidden state, hs[L])")
        vocab = int(config.get("vocab_size") or 0)
        if checkpoint.has("embed_tokens.weight"):
            vocab = checkpoint.shape("embed_tokens.weight")[0]
        notes = [f"dropped {name} (shared with the target at load time)" for name in dropped]
        if "fc.bias" in tensors and config.get("bias") is False:
            notes.append("config says bias=false but the weights have fc.bias; following the weights")
        native = native_config("eagle", layer, vocab_size=vocab, draft_vocab_size=vocab, target_hidden_size=h,
                               target_num_layers=layers, aux_layer_ids=(layers,), target_model=target_name,
                               fc_bias="fc.bias" in tensors, attention_bias=attention_bias,
                               sliding_window=sliding_window(config))
        return NormalizedHead(native, tensors, notes)


def _yuhuili_config(head: NormalizedHead, architectures: list[str]) -> dict:
    c = head.config
    model_type = "qwen2" if c["attention_bias"] else "llama"
    config = llama_layer_config(c, architectures, head_dtype(head.tensors), model_type)
    config["bias"] = bool(c["fc_bias"])
    config.update(provenance(head))
    return config


@register_exporter("vllm", "eagle")
def to_vllm(head: NormalizedHead) -> Exported:
    """vLLM builds its Llama layers' attention biases from `attention_bias or bias` (and q/k/v's alone from
    `qkv_bias`), so yuhuili's `bias` (the fc's) would give the draft layer biases no tensor fills."""
    notes = []
    if head.config["fc_bias"]:
        notes.append("this head has fc.bias, which vLLM's EAGLE fc lacks: vLLM 0.32 skips the tensor without a "
                     "word and serves the head without it (the demo head accepts the same either way)")
    config = {**_yuhuili_config(head, ["LlamaForCausalLM"]), "bias": False, "attention_bias": False,
              "qkv_bias": bool(head.config["attention_bias"])}
    window, window_notes = vllm_window(head.config)
    if window:
        # vLLM's llama_eagle numbers its layer `layers.{target layers + i}`, and its attention reads layer_types
        # at that number less `target_layer_count` (which llama_eagle3 sets and llama_eagle does not);
        # transformers wants one layer_types entry per num_hidden_layers
        config.update(window, target_layer_count=head.config["target_num_layers"])
        notes += window_notes
    return Exported(config, dict(head.tensors), notes=notes)


def refuse_window(head: NormalizedHead, layout: str) -> None:
    """A DraftsmithError for a windowed head in a layout that attends over the whole context."""
    if head.config.get("sliding_window") is not None:
        raise DraftsmithError(f"{layout} has no attention window: served there, this head (trained to attend over "
                              f"its newest {head.config['sliding_window']} positions) would draft as another one; "
                              "--to vllm keeps the window")


@register_exporter("sglang", "eagle")
def to_sglang(head: NormalizedHead) -> Exported:
    refuse_window(head, "SGLang's EAGLE-1 layer")
    return Exported(_yuhuili_config(head, ["LlamaForCausalLMEagle"]), dict(head.tensors))
