"""The gate where a target is known: after `draftsmith convert --target` and after `draftsmith train` saves
a head (`serve` runs it at start, `serve.openai.cli`). Conversion and training never load serving, so the
commands' handlers are these wrappers; `--no-check` skips the gate. `accelerate launch -m draftsmith.train`
runs the trainer alone: check its head with `draftsmith check` after."""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from draftsmith.models.loader import load_target
from draftsmith.serve.check.cli import check_head, native_head, verdict


def _gate(command: str, head: Path, target_dir: Path, workdir: Path) -> int:
    """The gate on `head` (any format convert reads) against `target_dir`: 0, or 1 with its one line."""
    result = check_head(native_head(head, target_dir, workdir), target_dir, load_target(target_dir), name=str(head))
    print(f"draftsmith {command}: acceptance gate {verdict(result)}")
    return 1 if result["failed"] else 0


def convert_then_check(args: argparse.Namespace) -> int:
    """`draftsmith convert`, then the gate on the head's native reading (what every export is written from)
    where --target names the target."""
    from draftsmith.convert.cli import run as convert

    status = convert(args)
    if status or args.no_check or args.inspect or not args.target:
        return status
    with tempfile.TemporaryDirectory(prefix="draftsmith-check-") as workdir:
        return _gate("convert", Path(args.src), Path(args.target), Path(workdir))


def train_then_check(args: argparse.Namespace) -> int:
    """`draftsmith train`, then the gate on the head it saved, against its training record."""
    from draftsmith.train.cli import train_recipe

    recipe, head = train_recipe(args)
    if args.no_check or args.eval_only:  # an eval writes no head to check
        return 0
    with tempfile.TemporaryDirectory(prefix="draftsmith-check-") as workdir:
        return _gate("train", head, Path(recipe.model.target), Path(workdir))
