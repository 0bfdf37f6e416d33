"""Greedy outputs of every method, recorded to JSON and compared: proof that a change to the engine, a method or
the house left what it generates token-identical.

    python -m draftsmith.tools.greedy_outputs record build/greedy-before.json
    ... change the code ...
    python -m draftsmith.tools.greedy_outputs record build/greedy-after.json
    python -m draftsmith.tools.greedy_outputs compare build/greedy-before.json build/greedy-after.json

Each model (`demo`: assets/demo-code-7m, `house`: ../shared's house-code-28m) generates 48 greedy tokens for six
code prompts, four requests in flight, fp32, with no speculation and with every method and tree shape at a
fixed k (adaptive speculation sizes steps by timing, so its drafts would differ run to run; its outputs are
compared too, as `eagle3-adaptive`). Demo uses the shipped heads. The house has none shipped: its heads are
trained a few steps on the shared corpus into `--heads-dir` the first time and reused after, so a before and an
after run read the same weights. Since speculation is lossless, every row also matches the plain row; `record`
prints where one does not.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ASSETS = REPO / "assets"
NUM_PROMPTS, MAX_TOKENS, PROMPT_CHARS = 6, 48, 700
# heads trained for the house model, by method: a few steps are enough to draft (the outputs must match
# plain decoding however little a head accepts)
HOUSE_HEADS = {"eagle3": {"draft_vocab_size": 2048}, "eagle": {},
               "dflash": {"block_size": 5}, "medusa": {"num_heads": 3}, "mtp": {}}


def model_dirs(shared: Path) -> dict[str, Path]:
    found = {"demo": ASSETS / "demo-code-7m"}
    house = shared / "models" / "house-code-28m"
    if house.is_dir():
        found["house"] = house
    return found


def prompts(shared: Path) -> list[str]:
    """Code prompts from repositories the heads never trained on where ../shared is here, else fixed ones."""
    validation = shared / "data" / "code-validation.jsonl.xz"
    if validation.is_file():
        from draftsmith.corpus import code_prompts

        return [text[-PROMPT_CHARS:] for text in code_prompts(validation, NUM_PROMPTS)]
    return [f"def function_{i}(values):\n    total = 0\n    for value in values:\n" for i in range(NUM_PROMPTS)]


def house_heads(target: Path, shared: Path, heads_dir: Path) -> dict[str, Path]:
    """The house heads of `HOUSE_HEADS`, trained now into heads_dir where missing."""
    from draftsmith.train.recipe import validate_recipe
    from draftsmith.train.trainer import train

    heads = {}
    for head_type, keys in HOUSE_HEADS.items():
        final = heads_dir / f"house-{head_type}" / "final"
        if not (final / "config.json").is_file():
            raw = {"model": {"target": str(target), "head_type": head_type, **keys},
                   "data": {"train_files": [str(shared / "data" / "code-train.jsonl.xz")], "format": "text",
                            "max_length": 256, "max_train_samples": 64, "eval_fraction": 0.0},
                   "training": {"output_dir": str(final.parent), "max_steps": 8, "batch_size": 4,
                                "learning_rate": 1e-3, "save_dtype": "float32", "seed": 0}}
            final = train(validate_recipe(raw), ["greedy_outputs"])
        heads[head_type] = final
    return heads


def configs(name: str, target: Path, shared: Path, heads_dir: Path) -> dict[str, dict | None]:
    """Row name -> speculative config (None: plain decoding) for one model."""
    if name == "demo":
        heads = {m: ASSETS / f"demo-code-7m-{m}" for m in ("eagle3", "dflash", "medusa", "mtp")}
    else:
        heads = house_heads(target, shared, heads_dir)
    draft, pard = ASSETS / "demo-code-7m", ASSETS / "demo-code-7m-pard"  # both targets share its vocabulary
    fixed = {"adaptive": False}
    rows: dict[str, dict | None] = {
        "none": None,
        "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, **fixed},
        "suffix": {"method": "suffix", "num_speculative_tokens": 8, **fixed},
        "eagle3": {"method": "eagle3", "model": str(heads["eagle3"]), "num_speculative_tokens": 5, **fixed},
        "eagle3-adaptive": {"method": "eagle3", "model": str(heads["eagle3"]), "num_speculative_tokens": 5},
        "eagle3-tree": {"method": "eagle3", "model": str(heads["eagle3"]), "num_speculative_tokens": 10,
                        "tree_depth": 5, "tree_top_k": 2, **fixed},
        "dflash": {"method": "dflash", "model": str(heads["dflash"]), "num_speculative_tokens": 4, **fixed},
        "dflash-tree": {"method": "dflash", "model": str(heads["dflash"]), "num_speculative_tokens": 8,
                        "tree_depth": 4, "tree_top_k": 2, **fixed},
        "medusa": {"method": "medusa", "model": str(heads["medusa"]), "num_speculative_tokens": 3, **fixed},
        "medusa-tree": {"method": "medusa", "model": str(heads["medusa"]), "num_speculative_tokens": 6,
                        "speculative_token_tree": "[(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]", **fixed},
        "mtp": {"method": "mtp", "model": str(heads["mtp"]), "num_speculative_tokens": 3, **fixed},
        "draft_model": {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 4, **fixed},
        "pard": {"method": "draft_model", "model": str(pard), "num_speculative_tokens": 6,
                 "parallel_drafting": True, **fixed},
    }
    if "eagle" in heads:
        rows["eagle-tree"] = {"method": "eagle", "model": str(heads["eagle"]), "num_speculative_tokens": 8,
                              "tree_depth": 4, "tree_top_k": 2, **fixed}
    return rows


def generate_rows(target_dir: Path, rows: dict[str, dict | None], texts: list[str]) -> dict[str, list[list[int]]]:
    from draftsmith.serve.apps.llm import LLM
    from draftsmith.serve.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs, target = {}, None
    for row, config in rows.items():
        llm = LLM(target_dir, dtype="float32", device="cpu", max_num_seqs=4, max_model_len=1024, target=target,
                  speculative_config=config)
        target = llm.model
        outputs[row] = [o.outputs[0].token_ids for o in llm.generate(texts, params, use_tqdm=False)]
        print(f"  {row:<16} {'same as none' if outputs[row] == outputs['none'] else 'DIFFERS FROM none'}",
              flush=True)
    return outputs


def record(args) -> int:
    shared = Path(args.shared)
    texts = prompts(shared)
    snapshot = {"prompts": texts, "max_tokens": MAX_TOKENS, "models": {}}
    for name, target_dir in model_dirs(shared).items():
        print(f"{name}: {target_dir}", flush=True)
        rows = configs(name, target_dir, shared, Path(args.heads_dir))
        snapshot["models"][name] = generate_rows(target_dir, rows, texts)
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(snapshot))
    print(f"wrote {args.output}")
    return 0


def compare(args) -> int:
    before, after = (json.loads(Path(p).read_text()) for p in (args.before, args.after))
    if before["prompts"] != after["prompts"]:
        print("the two snapshots used different prompts: record both with the same ../shared")
        return 1
    differing = 0
    for model, rows in before["models"].items():
        for row, outputs in rows.items():
            other = after["models"].get(model, {}).get(row)
            same = other == outputs
            differing += not same
            print(f"{model:<6} {row:<16} {'identical' if same else 'missing' if other is None else 'DIFFERENT'}")
    print(f"{differing} rows differ" if differing else "all rows token-identical")
    return 1 if differing else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m draftsmith.tools.greedy_outputs", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    rec = commands.add_parser("record", help="generate every row and write them to OUTPUT (JSON)")
    rec.add_argument("output")
    rec.add_argument("--shared", default=str(REPO.parent / "shared"), help="the shared folder (house model, data)")
    rec.add_argument("--heads-dir", default=str(REPO / "build" / "greedy-heads"),
                     help="where the house heads are trained once and read after")
    cmp = commands.add_parser("compare", help="exit 1 unless two snapshots are token-identical")
    cmp.add_argument("before")
    cmp.add_argument("after")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    return record(args) if args.command == "record" else compare(args)


if __name__ == "__main__":
    sys.exit(main())
