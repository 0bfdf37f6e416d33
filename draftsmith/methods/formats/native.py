"""draftsmith's native head format as a conversion source and output, and the atomic directory writer."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from draftsmith.errors import DraftsmithError
from draftsmith.methods import head_method, read_head_config
from draftsmith.methods.formats.checkpoint import SourceCheckpoint
from draftsmith.methods.formats.registry import Exported, NormalizedHead, ReadContext, register_source


@register_source("native", "draftsmith native head (config.json with draftsmith_head_type + model.safetensors)")
class Native:
    @staticmethod
    def detect(checkpoint: SourceCheckpoint) -> bool:
        return "draftsmith_head_type" in checkpoint.config

    @staticmethod
    def read(checkpoint: SourceCheckpoint, ctx: ReadContext) -> NormalizedHead:
        if "draftsmith_head_type" not in checkpoint.config:
            raise DraftsmithError(f"{checkpoint.directory}/config.json has no draftsmith_head_type: not a native head")
        # round-trip through the typed config: checks the keys and fills what older native configs lack
        parsed = read_head_config(checkpoint.config, checkpoint.directory / "config.json")
        head_class = head_method(parsed.head_type).head_module
        if getattr(parsed, "fc_bias", False) is None and head_class is not None:
            parsed.fc_bias = head_class.default_fc_bias
        config = parsed.to_json()
        return NormalizedHead(config, checkpoint.read(checkpoint.names))


def write_atomically(exported: Exported, out: str | Path, force: bool) -> Path:
    """Writes config.json + weights into a temporary sibling of `out`, then renames it into place, so a
    failure never leaves a half-written `out` (and an existing one is replaced only with `force`)."""
    out = Path(out)
    if out.exists() and not force:
        raise DraftsmithError(f"{out} already exists; pass --force to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    try:
        partial.mkdir()
        (partial / "config.json").write_text(json.dumps(exported.config, indent=2) + "\n")
        # safetensors refuses views and shared storage; every tensor gets its own contiguous copy.
        tensors = {k: v.detach().to("cpu").contiguous().clone() for k, v in exported.tensors.items()}
        if exported.weights_name.endswith(".safetensors"):
            save_file(tensors, str(partial / exported.weights_name), metadata={"format": "pt"})
        else:
            torch.save(tensors, partial / exported.weights_name)
        if out.exists():
            old = out.parent / f".{out.name}.old-{os.getpid()}"
            out.rename(old)
            partial.rename(out)
            shutil.rmtree(old) if old.is_dir() else old.unlink()
        else:
            partial.rename(out)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return out
