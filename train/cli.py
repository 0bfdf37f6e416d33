"""Entry points for `draftsmith train`, `draftsmith capture`, `-m draftsmith.train`."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from draftsmith.errors import DraftsmithError


def train_recipe(args: argparse.Namespace):
    """Trains `args.recipe` with `args.overrides` -> (the recipe, the path of the head it saved)."""
    from draftsmith.train.recipe import load_recipe
    from draftsmith.train.trainer import train

    recipe = load_recipe(args.recipe, args.overrides)
    argv = ["draftsmith", "train", args.recipe, *args.overrides]
    if getattr(args, "eval_only", False):  # `-m draftsmith.train` has no such flag
        return recipe, Path(train(recipe, argv, eval_only=True))
    return recipe, Path(train(recipe, argv))


def run_train(args: argparse.Namespace) -> int:
    train_recipe(args)
    return 0


def main(argv: list[str]) -> int:
    """`python -m draftsmith.train RECIPE [overrides]` (what `accelerate launch -m` runs on every rank)."""
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__ + "\nusage: accelerate launch -m draftsmith.train RECIPE.yaml [section.key=value ...]")
        return 0 if argv else 2
    try:
        status = run_train(argparse.Namespace(recipe=argv[0], overrides=argv[1:]))
    except DraftsmithError as exc:
        print(f"draftsmith train: error: {exc}", file=sys.stderr)
        return 2
    return _leave(status)


def _leave(status: int) -> int:
    """A worker of a multi-process run leaves without the interpreter's teardown once training has finished
    and saved: torch's C++ threads (gloo, FSDP) can abort a process there ("terminate called without an
    active exception", seen once in six runs of two CPU ranks), making a finished job look failed, and
    destroying gloo's process group can deadlock (the trainer keeps what holds it referenced until here)."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    return status


def run_capture(args: argparse.Namespace) -> int:
    from draftsmith.corpus import load_records
    from draftsmith.models.config import TargetConfig
    from draftsmith.models.loader import load_target
    from draftsmith.models.tokenizer import load_tokenizer
    from draftsmith.train.capture import TargetFeatures, capture
    from draftsmith.train.data import tokenize_dataset
    from draftsmith.train.recipe import load_recipe
    from draftsmith.train.trainer import feature_layers_of

    if args.engine != "vllm":
        given = [flag for flag, value in (("--tensor-parallel-size", args.tensor_parallel_size != 1),
                                          ("--enforce-eager", args.enforce_eager), ("--vllm-python", args.vllm_python),
                                          ("--max-num-seqs", args.max_num_seqs))
                 if value]
        if given:
            raise DraftsmithError(f"{', '.join(given)}: vLLM's, for --engine vllm")
    recipe = load_recipe(args.recipe, args.overrides)
    out = args.output or recipe.data.hidden_states_dir
    if not out:
        raise DraftsmithError("say where to write: --output DIR or data.hidden_states_dir in the recipe")
    tokenizer = load_tokenizer(Path(recipe.model.target))
    d = recipe.data
    tokenized = tokenize_dataset(load_records(d.train_files, d.max_train_samples), tokenizer, d.max_length, d.format,
                                 d.mask_prompt)
    aux = feature_layers_of(recipe, TargetConfig.from_model_dir(recipe.model.target).num_hidden_layers)
    if args.engine == "vllm":
        import torch

        from draftsmith.train.vllm_capture import VllmFeatures

        # vLLM on the GPU where there is one (its CPU settings bind threads and turn its processes off)
        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        longest = max((len(ids) for ids in tokenized["input_ids"]), default=1)
        source = VllmFeatures(recipe.model.target, aux, args.vllm_python, device, longest + 1,
                              args.max_num_seqs, args.tensor_parallel_size, args.enforce_eager)
    else:
        source = TargetFeatures(load_target(recipe.model.target, dtype="float32", device=args.device or "cpu"))
    failed = True
    try:
        capture(source, aux, tokenized, out, d.hidden_states_dtype, args.samples_per_shard,
                meta={"target": recipe.model.target, "train_files": d.train_files, "max_length": d.max_length})
        failed = False
    finally:
        source.close(keep_log=failed)  # an error names vLLM's log: it stays
    print(f"captured hidden states in {out}")
    return 0
