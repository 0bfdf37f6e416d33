"""`draftsmith convert`: detect a checkpoint's format, normalize it, check it against the target, export it."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from draftsmith.acceptance_record import RECORD_FILE, carry_record
from draftsmith.errors import DraftsmithError
from draftsmith.methods import head_method, read_head_config, servable
from draftsmith.methods.formats import native as native_format
from draftsmith.methods.formats.checkpoint import SourceCheckpoint, local_directory
from draftsmith.methods.formats.registry import (
    Exported,
    NormalizedHead,
    ReadContext,
    detect_source,
    exporter,
    load_formats,
)
from draftsmith.models.config import TargetConfig
from draftsmith.models.dtypes import DTYPES

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
NAMES_VERIFIER = ("speculators",)  # export formats whose config names the target model to load


def validate_against_target(head: NormalizedHead, target_dir: Path, source_dir: Path) -> None:
    """Shapes, vocab, fused layer ids and tokenizer of the head against the target; errors name both values."""
    from draftsmith.models.tokenizer import load_tokenizer

    target = TargetConfig.from_model_dir(target_dir)
    read_head_config(head.config).check_target(target)
    vocab = head.config.get("vocab_size")
    tokenizer = load_tokenizer(target_dir)
    if vocab is not None and len(tokenizer) > vocab:
        raise DraftsmithError(f"the target's tokenizer has {len(tokenizer)} tokens but the head's vocab size is {vocab}")
    if any((source_dir / name).is_file() for name in TOKENIZER_FILES):
        draft_tokenizer = load_tokenizer(source_dir)
        if draft_tokenizer.get_vocab() != tokenizer.get_vocab():
            raise DraftsmithError(f"the checkpoint's tokenizer ({len(draft_tokenizer)} tokens) differs from the "
                                  f"target's ({len(tokenizer)} tokens): the head was trained for another tokenizer")


def _locate_target(head: NormalizedHead, target_dir: Path | None, source_dir: Path, output: str) -> None:
    """Names the target by a path that works from any directory: --target's, else the recorded one made absolute
    where it is a directory here (relative to the working directory or to the source checkpoint). A recorded
    path such as `assets/demo-code-7m` copied into an export as it is would load only from one directory; from
    any other, vLLM would look for it on the hub. What is not found stays as it is (it may be a hub id),
    with a warning where the export names its verifier."""
    recorded = head.config.get("target_model") or ""
    if target_dir is not None:
        head.config["target_model"] = str(target_dir.resolve())
        return
    found = local_directory(recorded, source_dir)
    if found is not None:
        head.config["target_model"] = str(found)
        return
    if output in NAMES_VERIFIER:
        found = f"the recorded target {recorded!r} is not a directory here" if recorded else "no target is recorded"
        print(f"warning: {found}; the export names it as it is (vLLM resolves a name it cannot find on the hub); "
              "pass --target TARGET_DIR to name a local one")


def _cast(head: NormalizedHead, dtype: str | None) -> None:
    if dtype:
        head.tensors = {k: v.to(DTYPES[dtype]) if v.is_floating_point() else v for k, v in head.tensors.items()}


def _summary(source, head: NormalizedHead, exported: Exported, output: str) -> str:
    floats = [v for v in exported.tensors.values() if v.is_floating_point()]
    dtypes = sorted({str(v.dtype).removeprefix("torch.") for v in floats})
    lines = [f"format:     {source.name} ({source.description})",
             f"method:     {head.head_type}",
             f"tensors:    {len(exported.tensors)}",
             f"parameters: {sum(v.numel() for v in floats):,}",
             f"dtype:      {', '.join(dtypes) or '-'}",
             *[f"note:       {n}" for n in head.notes + exported.notes],
             f"config.json it would write (--to {output}):",
             json.dumps(exported.config, indent=2)]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if not args.inspect and not args.out:
        raise DraftsmithError("say where to write: draftsmith convert SRC OUT (or --inspect SRC to only look)")
    out = Path(args.out) if args.out else None
    if out is not None and out.exists() and not args.force:
        raise DraftsmithError(f"{out} already exists; pass --force to replace it")
    checkpoint = SourceCheckpoint(args.src)
    sources = load_formats()
    if args.from_format:
        if args.from_format not in sources:
            raise DraftsmithError(f"--from {args.from_format!r} is not a known format; one of: {', '.join(sources)}")
        source = sources[args.from_format]
        if not source.detect(checkpoint):
            print(f"warning: {args.src} does not look like {source.name}; reading it as that because of --from")
    else:
        source = detect_source(checkpoint)
    target_dir = Path(args.target) if args.target else None
    ctx = ReadContext(TargetConfig.from_model_dir(target_dir), str(target_dir)) if target_dir else ReadContext()
    head = source.read(checkpoint, ctx)
    _cast(head, args.dtype)
    if target_dir is not None:
        validate_against_target(head, target_dir, checkpoint.directory)
    _locate_target(head, target_dir, checkpoint.directory, args.to)
    exported = exporter(args.to, head.head_type)(head)
    if args.inspect:
        print(_summary(source, head, exported, args.to))
        return 0
    print(f"detected {source.name}: {source.description}")
    for note in head.notes + exported.notes:
        print(f"  note: {note}")
    native_format.write_atomically(exported, out, args.force)
    if carry_record(checkpoint.directory, out):
        print(f"  note: the head's acceptance record ({RECORD_FILE}) goes with it")
    print(f"wrote {out} ({args.to} {head.head_type} head, {len(exported.tensors)} tensors)")
    if args.to == "native" and servable(head_method(head.head_type)):
        k = min(5, read_head_config(head.config).max_drafts() or 5)  # a head or stage a draft: no more than it has
        print(f"serve it: draftsmith serve TARGET --speculative-config "
              f"'{{\"method\": \"{head.head_type}\", \"model\": \"{out}\", \"num_speculative_tokens\": {k}}}'")
    return 0
