"""IBM / fms MLP speculators: HF-saved keys under `speculator.`, stages
`emb.i`, `proj.i`, `head.i`, `ln.i` (weight and bias), optionally tied, optionally with `scale_input`.

Native keys drop the prefix. A tied speculator keeps only the tensors its stages share (emb.0, proj.0,
proj.1, head.0, ln.0), as TGI reads it; tied duplicates in the source must equal them.
"""

from __future__ import annotations

import re

import torch

from draftsmith.errors import DraftsmithError
from draftsmith.methods.formats.checkpoint import SourceCheckpoint
from draftsmith.methods.formats.registry import (
    Exported,
    NormalizedHead,
    ReadContext,
    provenance,
    register_exporter,
    register_source,
)
from draftsmith.models.head_configs import MLPSpeculatorConfig

PREFIX = "speculator."
VLLM_CANNOT_SERVE = ("vLLM cannot serve this export: its V1 engine (0.32) has MLPSpeculatorPreTrainedModel disabled "
                     "in its model registry; this is the layout vLLM's V0 engine and TGI load. For vLLM today, "
                     "serve it with draftsmith, or train an EAGLE-3 head (recipes/eagle3-demo.yaml) for vLLM")
STAGE_KEY = re.compile(r"^(emb|proj|head|ln)\.(\d+)\.(weight|bias)$")


def _stage_names(n: int, tied: bool) -> list[str]:
    """Native tensor names of an n-stage speculator."""
    emb_heads = range(1 if tied else n)
    projs = range(min(n, 2) if tied else n)
    return ([f"emb.{i}.weight" for i in emb_heads] + [f"proj.{i}.weight" for i in projs]
            + [f"head.{i}.weight" for i in emb_heads] + [f"ln.{i}.{p}" for i in emb_heads for p in ("weight", "bias")])


def _canonical(name: str) -> str:
    """The stage-0/1 tensor a tied stage's tensor shares."""
    kind, index, part = STAGE_KEY.match(name).groups()
    shared = "1" if kind == "proj" and int(index) >= 1 else "0"
    return f"{kind}.{shared}.{part}"


@register_source("mlp_speculator", "IBM/fms MLP speculator (speculator.emb/proj/head/ln.N)")
class MLPSpeculator:
    @staticmethod
    def detect(checkpoint: SourceCheckpoint) -> bool:
        if checkpoint.config.get("draftsmith_head_type"):
            return False
        names = {n.removeprefix(PREFIX) for n in checkpoint.names}
        return checkpoint.config.get("model_type") == "mlp_speculator" or {"emb.0.weight", "proj.0.weight", "head.0.weight"} <= names

    @staticmethod
    def read(checkpoint: SourceCheckpoint, ctx: ReadContext) -> NormalizedHead:
        c = checkpoint.config
        where = f"{checkpoint.directory}/config.json"
        if not c:
            raise DraftsmithError(f"{checkpoint.directory} has no config.json: MLP speculators need it (n_predict, tie_weights...)")
        prefix = PREFIX if any(n.startswith(PREFIX) for n in checkpoint.names) else ""
        unknown = [n for n in checkpoint.names if not STAGE_KEY.match(n.removeprefix(prefix))]
        if unknown:
            raise DraftsmithError(f"{checkpoint.path}: tensor(s) {', '.join(unknown[:5])} are not part of the MLP speculator layout")
        try:
            emb_dim, vocab, n = int(c["emb_dim"]), int(c["vocab_size"]), int(c["n_predict"])
        except KeyError as exc:
            raise DraftsmithError(f"{where} lacks {exc.args[0]!r}") from None
        inner = int(c.get("inner_dim") or emb_dim)
        tied = bool(c.get("tie_weights", False))
        top_k = list(c.get("top_k_tokens_per_head") or [5, 4, 3])
        if len(top_k) != n:
            raise DraftsmithError(f"{where}: top_k_tokens_per_head has {len(top_k)} entries but n_predict is {n}")
        wanted = _stage_names(n, tied)
        missing = [k for k in wanted if not checkpoint.has(prefix + k)]
        if missing:
            raise DraftsmithError(f"{checkpoint.path} lacks {', '.join(prefix + k for k in missing[:5])} "
                                  f"for n_predict={n}{' (tied)' if tied else ''}")
        source = checkpoint.read(checkpoint.names)
        tensors = {k: source[prefix + k] for k in wanted}
        stages = {int(STAGE_KEY.match(k.removeprefix(prefix)).group(2)) for k in source}
        if max(stages) >= n:
            raise DraftsmithError(f"{checkpoint.path} has stage {max(stages)} tensors but n_predict is {n}")
        notes = []
        if tied:
            for name, value in source.items():
                base = name.removeprefix(prefix)
                if base not in tensors and not torch.equal(value, tensors[_canonical(base)]):
                    raise DraftsmithError(f"tie_weights is true but {name} differs from {prefix}{_canonical(base)}")
            if len(source) > len(wanted):
                notes.append(f"tied: kept {len(wanted)} shared tensors of {len(source)} stored")
        shapes = {"emb": (vocab, inner), "head": (vocab, inner), "ln": (inner,)}
        for name, value in tensors.items():
            kind, index, _ = STAGE_KEY.match(name).groups()
            expected = ((inner, emb_dim) if index == "0" else (inner, inner)) if kind == "proj" else shapes[kind]
            if tuple(value.shape) != expected:
                raise DraftsmithError(f"{prefix}{name} has shape {tuple(value.shape)}, expected {expected}")
        config = MLPSpeculatorConfig(emb_dim=emb_dim, inner_dim=inner, vocab_size=vocab, n_predict=n, tie_weights=tied,
                                     scale_input=bool(c.get("scale_input", False)), top_k_tokens_per_head=top_k,
                                     n_candidates=int(c.get("n_candidates", 5)),
                                     target_model=(c.get("draftsmith") or {}).get("target_model") or ctx.target_name)
        return NormalizedHead(config.to_json(), tensors, notes)


@register_exporter("vllm", "mlp_speculator")
def to_vllm(head: NormalizedHead) -> Exported:
    """The HF layout vLLM (and TGI) load: `speculator.`-prefixed keys, every stage written out."""
    c = MLPSpeculatorConfig.from_json(head.config)
    tensors = {}
    for name in _stage_names(c.n_predict, False):
        tensors[PREFIX + name] = head.tensors[_canonical(name) if c.tie_weights else name]
    config = {"architectures": ["MLPSpeculatorPreTrainedModel"], "model_type": "mlp_speculator",
              "emb_dim": c.emb_dim, "inner_dim": c.inner_dim, "vocab_size": c.vocab_size, "n_predict": c.n_predict,
              "top_k_tokens_per_head": c.top_k_tokens_per_head, "n_candidates": c.n_candidates,
              "tie_weights": c.tie_weights, "scale_input": c.scale_input,
              "torch_dtype": str(tensors[PREFIX + "emb.0.weight"].dtype).removeprefix("torch."), **provenance(head)}
    return Exported(config, tensors, notes=[VLLM_CANNOT_SERVE])
