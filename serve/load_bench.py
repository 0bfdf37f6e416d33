"""`draftsmith bench-serve`: a fixed-concurrency HTTP load check, without and with speculation, one run."""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from pathlib import Path

from draftsmith.corpus import code_prompts
from draftsmith.errors import DraftsmithError
from draftsmith.serve.llm import LLM
from draftsmith.serve.serve_cli import build_server_app, server_in_thread


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


async def _drive(url: str, prompts: list[str], concurrency: int, max_tokens: int) -> dict[str, float]:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
    gate = asyncio.Semaphore(concurrency)
    latencies: list[float] = []
    tokens = 0

    async def one(prompt: str) -> None:
        nonlocal tokens
        async with gate:
            start = time.perf_counter()
            out = await client.completions.create(model="bench", prompt=prompt, max_tokens=max_tokens,
                                                  temperature=0, extra_body={"ignore_eos": True})
            latencies.append(time.perf_counter() - start)
            tokens += out.usage.completion_tokens

    start = time.perf_counter()
    async with client:
        await asyncio.gather(*(one(p) for p in prompts))
    elapsed = time.perf_counter() - start
    return {"requests_per_s": len(prompts) / elapsed, "output_tokens_per_s": tokens / elapsed,
            "p50_latency_s": statistics.median(latencies), "p99_latency_s": percentile(latencies, 99)}


def run(args: argparse.Namespace) -> int:
    shared = Path(args.shared)
    data = shared / "data" / "code-validation.jsonl.xz"
    if not data.is_file():
        raise DraftsmithError(f"benchmark data {data} not found; pass --shared DIR")
    prompts = code_prompts(data, args.num_requests)
    print(f"HTTP load: {args.num_requests} requests, concurrency {args.concurrency}, {args.max_tokens} tokens each, "
          f"greedy, CPU; speculation: {args.speculative_config}")
    for name in args.models.split(","):
        results = {}
        for label, spec in (("plain", None), ("spec", args.speculative_config)):
            llm = LLM(shared / "models" / name, dtype="float32", device="cpu", max_num_seqs=args.concurrency,
                      speculative_config=spec)
            with server_in_thread(build_server_app(llm, "bench", max_queue=args.num_requests)) as url:
                asyncio.run(_drive(url, prompts[:2], args.concurrency, 4))  # warm-up
                results[label] = asyncio.run(_drive(url, prompts, args.concurrency, args.max_tokens))
        ratio = results["spec"]["requests_per_s"] / results["plain"]["requests_per_s"]
        for label, r in results.items():
            print(f"model={name}  {label:5s}  " + "  ".join(f"{k}={v:.3f}" for k, v in r.items()), flush=True)
        print(f"model={name}  spec/plain requests_per_s ratio={ratio:.2f}", flush=True)
    return 0
