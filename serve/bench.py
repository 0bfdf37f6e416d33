"""`draftsmith bench`: decode throughput on validation code prompts, side by side in one run.

For each model it times, on the same prompts and greedy settings: HF transformers `generate` one prompt
at a time (the baseline users know), our engine one prompt at a time without speculation and with each
speculation method (the --speculative-config one, n-gram by default, and every head that ships for the
model in assets/MODEL-HEADTYPE), and our engine with all
prompts batched. Ratios are taken within the run, never against numbers from another machine or day.
Speculative outputs are also checked token for token against the plain ones.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from draftsmith.corpus import code_prompts
from draftsmith.errors import DraftsmithError
from draftsmith.methods import method_names, resolve_method, servable
from draftsmith.serve.llm import LLM
from draftsmith.serve.sampling_params import SamplingParams

ASSETS = Path(__file__).resolve().parents[1] / "assets"


def _time_engine(llm: LLM, prompts: list[str], params: SamplingParams, batched: bool):
    start = time.perf_counter()
    if batched:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    else:
        outputs = [llm.generate(p, params, use_tqdm=False)[0] for p in prompts]
    elapsed = time.perf_counter() - start
    return elapsed, outputs


def _time_hf(model_dir: Path, tokenizer, prompts: list[str], max_tokens: int) -> tuple[float, int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    tokens, start = 0, time.perf_counter()
    with torch.inference_mode():
        for prompt in prompts:
            ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False).input_ids
            out = model.generate(ids, max_new_tokens=max_tokens, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id)
            tokens += out.shape[1] - ids.shape[1]
    return time.perf_counter() - start, tokens


def shipped_heads(model_name: str) -> dict[str, Path]:
    """Heads shipped for a model, by method: `assets/MODEL-HEADTYPE` for every servable head-based method."""
    found = {}
    for name in method_names(lambda m: servable(m) and m.needs.head):
        head = ASSETS / f"{model_name}-{resolve_method(name).head_type}"
        if head.is_dir():
            found[name] = head
    return found


def speculation_methods(model_name: str, spec_config: str | None, k: int) -> dict[str, dict]:
    methods = {}
    if spec_config:
        config = json.loads(spec_config)
        methods[config.get("method", "?")] = config
    for name, head in shipped_heads(model_name).items():
        if name not in methods:  # the user's own config for a method wins over the shipped head
            methods[name] = {"method": name, "model": str(head), "num_speculative_tokens": k}
    return methods


def _count(outputs) -> int:
    return sum(len(o.outputs[0].token_ids) for o in outputs)


def run(args: argparse.Namespace) -> int:
    shared = Path(args.shared)
    data = shared / "data" / "code-validation.jsonl.xz"
    if not data.is_file():
        raise DraftsmithError(f"benchmark data {data} not found; pass --shared DIR (the folder holding data/ and models/)")
    prompts = code_prompts(data, args.num_prompts)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    warm = SamplingParams(temperature=0, max_tokens=8)
    rows = []
    print(f"{len(prompts)} validation code prompts, greedy, {args.max_tokens} new tokens, fp32, "
          f"{torch.get_num_threads()} CPU threads")
    for name in args.models.split(","):
        model_dir = shared / "models" / name
        llm = LLM(model_dir, dtype="float32", device="cpu", max_num_seqs=max(len(prompts), 1))
        llm.generate(prompts[0], warm, use_tqdm=False)
        secs, plain = _time_engine(llm, prompts, params, batched=False)
        base = {"model": name, "bs1_tokens_per_s": _count(plain) / secs}
        secs, batched = _time_engine(llm, prompts, params, batched=True)
        base[f"bs{len(prompts)}_tokens_per_s"] = _count(batched) / secs
        if not args.no_hf:
            secs, toks = _time_hf(model_dir, llm.tokenizer, prompts, args.max_tokens)
            base["hf_bs1_tokens_per_s"] = toks / secs
            base["bs1_speedup_vs_hf"] = base["bs1_tokens_per_s"] / base["hf_bs1_tokens_per_s"]
        _print(base)
        rows.append(base)
        plain_ids = [o.outputs[0].token_ids for o in plain]
        for method, config in speculation_methods(name, args.speculative_config, args.head_k).items():
            spec = LLM(model_dir, dtype="float32", device="cpu", max_num_seqs=max(len(prompts), 1),
                       speculative_config=config)
            spec.generate(prompts[0], warm, use_tqdm=False)
            spec.engine.spec_metrics.reset()  # drop the warm-up's counts
            secs, outputs = _time_engine(spec, prompts, params, batched=False)
            metrics = spec.get_metrics()
            row = {"model": name, "method": method, "k": config["num_speculative_tokens"],
                   "spec_bs1_tokens_per_s": _count(outputs) / secs}
            row["speedup_vs_no_spec"] = row["spec_bs1_tokens_per_s"] / base["bs1_tokens_per_s"]
            row["mean_acceptance_length"] = metrics["mean_acceptance_length"]
            row["accepted_per_position"] = "/".join(str(n) for n in metrics["accepted_per_position"])
            row["greedy_equal"] = [o.outputs[0].token_ids for o in outputs] == plain_ids
            _print(row)
            rows.append(row)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    return 0


def _print(row: dict) -> None:
    print("  ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
