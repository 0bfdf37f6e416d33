"""The converter registries: source formats (detect + read into draftsmith's normalized form) and exporters
(normalized form -> what a serving stack loads), each resolved once by name.

The normalized form of a head is exactly draftsmith's native format: a `config.json` whose
`draftsmith_head_type` names the head, and one `model.safetensors`. Every reader produces it and every
exporter starts from it, so N sources and M outputs need N + M mappings, not N x M.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from draftsmith.errors import DraftsmithError
from draftsmith.methods.formats.checkpoint import SourceCheckpoint
from draftsmith.models.config import TargetConfig

# Exported configs carry this block so a head read back from vLLM/SGLang/speculators layouts regains
# what those layouts have no key for (the target's layer count and name); serving stacks ignore it.
PROVENANCE_KEY = "draftsmith"


@dataclass
class NormalizedHead:
    config: dict[str, Any]  # native config.json
    tensors: dict[str, torch.Tensor]
    notes: list[str] = field(default_factory=list)  # decisions worth telling the user (dropped tensors, conventions)

    @property
    def head_type(self) -> str:
        return self.config["draftsmith_head_type"]


@dataclass
class Exported:
    config: dict[str, Any]
    tensors: dict[str, torch.Tensor]
    weights_name: str = "model.safetensors"
    notes: list[str] = field(default_factory=list)


@dataclass
class ReadContext:
    """What a reader may need beyond the checkpoint: the target (from --target), when given."""

    target: TargetConfig | None = None
    target_name: str = ""

    def target_layers(self, why: str) -> int:
        if self.target is None:
            raise DraftsmithError(f"{why}; pass --target TARGET_DIR (the target model's directory)")
        return self.target.num_hidden_layers


@dataclass(frozen=True)
class SourceFormat:
    name: str
    description: str
    detect: Callable[[SourceCheckpoint], bool]
    read: Callable[[SourceCheckpoint, ReadContext], NormalizedHead]


SOURCES: dict[str, SourceFormat] = {}
EXPORTERS: dict[tuple[str, str], Callable[[NormalizedHead], Exported]] = {}
OUTPUTS = ("native", "vllm", "sglang", "speculators")


def load_formats() -> dict[str, SourceFormat]:
    """Imports the native format and every registered method's converter modules (which register their
    sources and exporters); the formats a user can name are exactly what the methods bring."""
    import importlib

    from draftsmith.methods import METHODS

    importlib.import_module("draftsmith.methods.formats.native")
    for method in METHODS.values():
        method.import_converters()
    return SOURCES


def register_source(name: str, description: str):
    def decorate(cls):
        if name in SOURCES:
            raise ValueError(f"source format {name!r} registered twice")
        SOURCES[name] = SourceFormat(name, description, cls.detect, cls.read)
        return cls

    return decorate


def register_exporter(output: str, head_type: str):
    def decorate(fn):
        if output not in OUTPUTS:
            raise ValueError(f"unknown output {output!r}")
        EXPORTERS[(output, head_type)] = fn
        return fn

    return decorate


def detect_source(checkpoint: SourceCheckpoint) -> SourceFormat:
    matches = [fmt for fmt in load_formats().values() if fmt.detect(checkpoint)]
    if len(matches) == 1:
        return matches[0]
    if not matches:
        sample = ", ".join(sorted(checkpoint.names)[:8])
        raise DraftsmithError(f"cannot tell the format of {checkpoint.path} (tensors: {sample}...); name it with "
                              f"--from, one of: {', '.join(SOURCES)}")
    names = ", ".join(fmt.name for fmt in matches)
    raise DraftsmithError(f"{checkpoint.path} looks like several formats ({names}); choose one with --from")


def _native(head: NormalizedHead) -> Exported:
    return Exported(dict(head.config), dict(head.tensors))


def exporter(output: str, head_type: str) -> Callable[[NormalizedHead], Exported]:
    if output == "native":  # the normalized form is the native format: every head type has it
        return _native
    if (output, head_type) not in EXPORTERS:
        able = sorted(o for o, h in EXPORTERS if h == head_type)
        raise DraftsmithError(f"no {output!r} export for {head_type!r} heads; available: {', '.join(able) or 'none'}")
    return EXPORTERS[(output, head_type)]


def provenance(head: NormalizedHead) -> dict[str, Any]:
    c = head.config
    return {PROVENANCE_KEY: {"head_type": c["draftsmith_head_type"], "target_model": c.get("target_model", ""),
                             "target_num_layers": c.get("target_num_layers"),
                             "aux_layer_ids": c.get("aux_layer_ids")}}


def take(checkpoint: SourceCheckpoint, names: list[str], optional: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """Reads `names` (each must exist) and those of `optional` that do."""
    missing = [n for n in names if not checkpoint.has(n)]
    if missing:
        raise DraftsmithError(f"{checkpoint.path} lacks tensor(s) {', '.join(missing)}")
    return checkpoint.read(list(names) + [n for n in optional if checkpoint.has(n)])


def reject_unknown(checkpoint: SourceCheckpoint, known: set[str], fmt: str, ignorable: tuple[str, ...] = ()) -> list[str]:
    """Tensors a format does not define are an error (a variant we would silently mis-serve); `ignorable`
    suffixes/prefixes (rotary caches, frozen embedding copies) are dropped and returned for the notes."""
    dropped, unknown = [], []
    for name in checkpoint.names:
        if name in known:
            continue
        if any(name.endswith(s) or name.startswith(s) for s in ignorable):
            dropped.append(name)
        else:
            unknown.append(name)
    if unknown:
        raise DraftsmithError(f"{checkpoint.path}: tensor(s) {', '.join(sorted(unknown)[:6])} are not part of the "
                              f"{fmt} layout draftsmith converts (an unsupported variant?)")
    return dropped
