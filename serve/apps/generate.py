"""`draftsmith generate`: JSONL prompts in, JSONL completions (and optional metrics JSON) out."""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

from draftsmith.errors import DraftsmithError
from draftsmith.serve.apps.llm import LLM, engine_kwargs
from draftsmith.serve.engine.sampling_params import SamplingParams
from draftsmith.serve.engine.structured_outputs import StructuredOutputsParams


def read_prompt_file(path: Path) -> list[dict]:
    """Each line is {"prompt": str} or {"messages": [...]}; the error names the file and line."""
    if not path.is_file():
        raise DraftsmithError(f"prompts file {path} does not exist")
    records = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path} line {number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DraftsmithError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from None
        if not isinstance(record, dict):
            raise DraftsmithError(f"{where}: expected a JSON object")
        if isinstance(record.get("prompt"), str):
            records.append({"prompt": record["prompt"]})
        elif isinstance(record.get("messages"), list) and all(
            isinstance(m, dict) and "role" in m and "content" in m for m in record["messages"]
        ):
            records.append({"messages": record["messages"]})
        else:
            raise DraftsmithError(
                f"{where}: expected \"prompt\" (a string) or \"messages\" (a list of {{role, content}})"
            )
    if not records:
        raise DraftsmithError(f"prompts file {path} has no prompts")
    return records


FLAGGED = ("temperature", "top_p", "top_k", "max_tokens", "seed")  # set by their own flags


def further_params(text: str | None) -> dict:
    """--sampling-params: a JSON object of SamplingParams fields (vLLM's names) beyond the flags'."""
    if text is None:
        return {}
    try:
        fields = json.loads(text)
    except json.JSONDecodeError as exc:
        raise DraftsmithError(f"--sampling-params: not valid JSON ({exc.msg})") from None
    known = {f.name for f in dataclasses.fields(SamplingParams)} - set(FLAGGED) - {"bad_words_token_ids", "compiled_grammar"}
    if not isinstance(fields, dict) or set(fields) - known:
        unknown = sorted(set(fields) - known) if isinstance(fields, dict) else "not an object"
        raise DraftsmithError(f"--sampling-params: unknown fields {unknown}; known: {', '.join(sorted(known))}")
    if "logit_bias" in fields:
        fields["logit_bias"] = {int(k): v for k, v in fields["logit_bias"].items()}
    if "structured_outputs" in fields:
        try:
            fields["structured_outputs"] = StructuredOutputsParams(**fields["structured_outputs"])
        except TypeError as exc:
            raise DraftsmithError(f"--sampling-params: structured_outputs: {exc}") from None
    return fields


def run(args: argparse.Namespace) -> int:
    records = read_prompt_file(Path(args.prompts))
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_tokens, seed=args.seed, **further_params(args.sampling_params))
    llm = LLM(args.model, **engine_kwargs(args))
    prompts = [r["prompt"] if "prompt" in r else llm.apply_chat_template(r["messages"]) for r in records]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    output_path = Path(args.output)
    output_path.parent.mkdir(parents=True, exist_ok=True)
    with output_path.open("w", encoding="utf-8") as f:
        for index, out in enumerate(outputs):
            completion = out.outputs[0]
            f.write(json.dumps({
                "index": index, "text": completion.text, "token_ids": completion.token_ids,
                "num_prompt_tokens": len(out.prompt_token_ids), "finish_reason": completion.finish_reason,
            }) + "\n")
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    metrics = {"elapsed_s": elapsed, "num_requests": len(outputs), "num_generated_tokens": generated,
               "tokens_per_s": generated / elapsed if elapsed > 0 else 0.0, **llm.get_metrics()}
    if args.metrics_json:
        Path(args.metrics_json).write_text(json.dumps(metrics, indent=2) + "\n")
    print(f"{len(outputs)} completions, {generated} tokens in {elapsed:.2f} s = {metrics['tokens_per_s']:.1f} tokens/s"
          f" -> {output_path}")
    return 0
