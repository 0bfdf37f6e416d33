"""Medusa heads: FasterDecoding's `medusa_lm_head.pt`/`.safetensors` with keys
`{h}.{j}.linear.weight/bias` and `{h}.{L}.weight`, or vLLM's `blocks.{h}.layers.{j}`, `lm_heads.{h}`.

The head and layer counts come from the keys: published configs are known to disagree with them.
Native keys are vLLM's names (`blocks.*`, `lm_heads.*`), which say what each tensor is.
"""

from __future__ import annotations

import re

from draftsmith.errors import DraftsmithError
from draftsmith.methods.formats.checkpoint import SourceCheckpoint, target_lm_head
from draftsmith.methods.formats.registry import (
    Exported,
    NormalizedHead,
    ReadContext,
    provenance,
    register_exporter,
    register_source,
)
from draftsmith.models.head_configs import MedusaConfig

FASTER = re.compile(r"^(\d+)\.(\d+)\.(?:linear\.(weight|bias)|(weight))$")
VLLM = re.compile(r"^(?:medusa_heads\.)?(?:blocks\.(\d+)\.layers\.(\d+)\.(weight|bias)|lm_heads\.(\d+)\.weight)$")


def _parse(names: list[str]) -> tuple[str, dict[str, tuple[int, int, str]]]:
    """('faster' | 'vllm' | '', {name: (head, index, part)}); part is weight/bias of a ResBlock, or "lm"."""
    faster = {n: FASTER.match(n) for n in names}
    if faster and all(faster.values()):
        return "faster", {n: (int(m[1]), int(m[2]), m[3] or "lm") for n, m in faster.items()}
    vllm = {n: VLLM.match(n) for n in names}
    if vllm and all(vllm.values()):
        return "vllm", {n: (int(m[4]), -1, "lm") if m[4] is not None else (int(m[1]), int(m[2]), m[3])
                        for n, m in vllm.items()}
    return "", {}


@register_source("medusa", "Medusa heads (FasterDecoding medusa_lm_head.pt/.safetensors, or vLLM blocks.*/lm_heads.*)")
class Medusa:
    @staticmethod
    def detect(checkpoint: SourceCheckpoint) -> bool:
        return not checkpoint.config.get("draftsmith_head_type") and bool(_parse(checkpoint.names)[0])

    @staticmethod
    def read(checkpoint: SourceCheckpoint, ctx: ReadContext) -> NormalizedHead:
        style, parsed = _parse(checkpoint.names)
        if not style:
            raise DraftsmithError(f"{checkpoint.path}: tensor names are neither FasterDecoding's nor vLLM's Medusa layout")
        source = checkpoint.read(checkpoint.names)
        heads = max(h for h, _, _ in parsed.values()) + 1
        blocks = [(h, j, part) for h, j, part in parsed.values() if part != "lm"]
        layers = max(j for _, j, _ in blocks) + 1 if blocks else 0
        tensors, lm_heads = {}, {}
        for name, (h, j, part) in parsed.items():
            if part != "lm":
                tensors[f"blocks.{h}.layers.{j}.{part}"] = source[name]
            elif style == "faster" and j != layers:
                raise DraftsmithError(f"{name}: a head's LM head must come right after its {layers} ResBlocks")
            else:
                lm_heads[h] = source[name]
        if not layers:
            raise DraftsmithError(f"{checkpoint.path}: Medusa heads without ResBlocks")
        expected = {f"blocks.{h}.layers.{j}.{p}" for h in range(heads) for j in range(layers) for p in ("weight", "bias")}
        if set(tensors) != expected:
            missing = sorted(expected - set(tensors))
            raise DraftsmithError(f"{checkpoint.path}: Medusa blocks are incomplete (missing {', '.join(missing[:4])})")
        c = checkpoint.config
        shared = bool(c.get("original_lm_head")) and sorted(lm_heads) == [0]
        if shared:  # vLLM's layout for heads on the target's LM head: a copy of it, which the native form omits
            lm_heads = {}
        if lm_heads and sorted(lm_heads) != list(range(heads)):
            raise DraftsmithError(f"{checkpoint.path}: only heads {sorted(lm_heads)} of {heads} have an LM head")
        hidden = tensors["blocks.0.layers.0.weight"].shape[0]
        for name, value in tensors.items():
            expected_shape = (hidden, hidden) if name.endswith("weight") else (hidden,)
            if tuple(value.shape) != expected_shape:
                raise DraftsmithError(f"{name} has shape {tuple(value.shape)}, expected {expected_shape}")
        vocab = lm_heads[0].shape[0] if lm_heads else int(c.get("vocab_size") or (ctx.target.vocab_size if ctx.target else 0))
        if not vocab:
            raise DraftsmithError("these Medusa heads use the target's LM head, so the vocab size comes from the "
                                  "target; pass --target TARGET_DIR")
        for h, weight in lm_heads.items():
            tensors[f"lm_heads.{h}.weight"] = weight
            if tuple(weight.shape) != (vocab, hidden):
                raise DraftsmithError(f"head {h} LM head has shape {tuple(weight.shape)}, expected {(vocab, hidden)}")
        notes = [f"{heads} heads x {layers} ResBlocks (counted from the keys)"]
        if shared:
            notes.append("lm_heads.0.weight is vLLM's copy of the target's LM head (original_lm_head): not kept")
        declared = c.get("medusa_num_heads") or c.get("num_heads")
        if declared and int(declared) != heads:
            notes.append(f"config says {declared} heads; the weights hold {heads}, which is what is kept")
        target_name = (c.get("draftsmith") or {}).get("target_model") or c.get("base_model_name_or_path") or ctx.target_name
        config = MedusaConfig(hidden_size=hidden, vocab_size=vocab, num_heads=heads, num_layers=layers,
                              own_lm_heads=bool(lm_heads), target_model=target_name or "")
        return NormalizedHead(config.to_json(), tensors, notes)


@register_exporter("vllm", "medusa")
def to_vllm(head: NormalizedHead) -> Exported:
    """vLLM's MedusaModel. Heads that read out through the target's LM head are `original_lm_head: true`, and
    vLLM then builds one LM head of its own, filled only from `lm_heads.0.weight`: so the export carries the
    target's there (without it vLLM's stays uninitialised, and accepts nothing)."""
    c = MedusaConfig.from_json(head.config)
    config = {"architectures": ["MedusaModel"], "model_type": "medusa", "hidden_size": c.hidden_size,
              "vocab_size": c.vocab_size, "truncated_vocab_size": c.vocab_size, "num_heads": c.num_heads,
              "num_hidden_layers": c.num_layers, "medusa_fc_bias": True, "original_lm_head": not c.own_lm_heads,
              **provenance(head)}
    tensors = dict(head.tensors)
    if not c.own_lm_heads:
        lm_head = target_lm_head(c.target_model, (c.vocab_size, c.hidden_size))
        if lm_head is None:
            raise DraftsmithError(f"these Medusa heads read out through the target's LM head, which vLLM loads from "
                                  f"the export (lm_heads.0.weight); the target {c.target_model!r} is not a model "
                                  "directory here: pass --target TARGET_DIR")
        tensors["lm_heads.0.weight"] = lm_head.to(tensors["blocks.0.layers.0.weight"].dtype)
    return Exported(config, tensors)
