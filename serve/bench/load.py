"""`draftsmith bench-serve`: a fixed-concurrency HTTP load check, without and with speculation, one run."""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from pathlib import Path

from draftsmith.corpus import code_prompts
from draftsmith.errors import DraftsmithError
from draftsmith.serve.apps.llm import LLM
from draftsmith.serve.openai.cli import build_process_server_app, build_server_app, server_in_thread


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


def _server(mode: str, model: Path, concurrency: int, spec, max_queue: int):
    """A server on loopback with the engine on a thread of its process, or in a process of its own."""
    kwargs = {"model": str(model), "dtype": "float32", "device": "cpu", "max_num_seqs": concurrency,
              "speculative_config": spec}
    if mode == "process":
        return server_in_thread(build_process_server_app(kwargs, "bench", max_queue=max_queue))
    return server_in_thread(build_server_app(LLM(**kwargs), "bench", max_queue=max_queue))


def run(args: argparse.Namespace) -> int:
    shared = Path(args.shared)
    data = shared / "data" / "code-validation.jsonl.xz"
    if not data.is_file():
        raise DraftsmithError(f"benchmark data {data} not found; pass --shared DIR")
    modes = [m for m in args.engine.split(",") if m]
    if not modes or set(modes) - {"thread", "process"}:
        raise DraftsmithError(f"--engine {args.engine!r}: a comma-separated list of thread and process")
    prompts = code_prompts(data, args.num_requests)
    print(f"HTTP load: {args.num_requests} requests, concurrency {args.concurrency}, {args.max_tokens} tokens each, "
          f"greedy, CPU; speculation: {args.speculative_config}; engine: {', '.join(modes)}")
    for name in args.models.split(","):
        results = {}
        for mode in modes:
            for label, spec in (("plain", None), ("spec", args.speculative_config)):
                with _server(mode, shared / "models" / name, args.concurrency, spec, args.num_requests) as url:
                    asyncio.run(_drive(url, prompts[:2], args.concurrency, 4))  # warm-up
                    results[(mode, label)] = asyncio.run(_drive(url, prompts, args.concurrency, args.max_tokens))
        for (mode, label), r in results.items():
            print(f"model={name}  engine={mode:7s}  {label:5s}  " + "  ".join(f"{k}={v:.3f}" for k, v in r.items()),
                  flush=True)
        for mode in modes:
            ratio = results[(mode, "spec")]["requests_per_s"] / results[(mode, "plain")]["requests_per_s"]
            print(f"model={name}  engine={mode}  spec/plain requests_per_s ratio={ratio:.2f}", flush=True)
        if len(modes) == 2:
            for label in ("plain", "spec"):
                thread, process = results[("thread", label)], results[("process", label)]
                print(f"model={name}  {label}  process/thread: requests_per_s x{process['requests_per_s'] / thread['requests_per_s']:.2f}"
                      f"  p50 {thread['p50_latency_s']:.3f} -> {process['p50_latency_s']:.3f} s"
                      f"  p99 {thread['p99_latency_s']:.3f} -> {process['p99_latency_s']:.3f} s", flush=True)
    return 0
