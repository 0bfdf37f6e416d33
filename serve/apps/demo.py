"""`draftsmith demo`: start `draftsmith serve` on the embedded demo model with the first head shipped beside
it (`MODEL-HEADTYPE`, servable methods tried in name order; today DFlash), or n-gram if there is none, talk
to it with the official `openai` client (one request streamed), print the text and the speculation metrics,
and stop the server. A newcomer's first minute, end to end."""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from draftsmith.errors import DraftsmithError
from draftsmith.methods import method_names, resolve_method, servable
from draftsmith.methods.ngram import CODE_DEFAULTS
from draftsmith.serve.openai.cli import free_port

DEMO_PROMPTS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fib",
    "import os\n\n\ndef list_python_files(root):\n    result = []\n    for dirpath, _, names in os.wa",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n        self.it",
    "def read_json(path):\n    with open(path) as f:\n        return json.lo",
]
ASSETS = Path(__file__).resolve().parents[2] / "assets"  # an editable install keeps the package beside it


def default_demo_model() -> Path:
    return ASSETS / "demo-code-7m"


def demo_speculation(model: Path) -> dict:
    """The head shipped beside the model (`MODEL-HEADTYPE`, e.g. demo-code-7m-eagle3), else n-gram."""
    for name in method_names(lambda m: servable(m) and m.needs.head):
        head = model.parent / f"{model.name}-{resolve_method(name).head_type}"
        if head.is_dir():
            return {"method": name, "model": str(head), "num_speculative_tokens": 5}
    return dict(CODE_DEFAULTS)


def wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout: float = 180) -> None:
    """Returns once `proc`, a `draftsmith serve` writing to `log`, answers /health with 200; one line else."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise DraftsmithError(f"server exited with status {proc.returncode}; its log: {log}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.25)
    raise DraftsmithError(f"server did not become healthy in {timeout:.0f} s; its log: {log}")


def _spec_counters(url: str) -> dict[str, float]:
    counters: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for sample in family.samples:
            if sample.name.startswith("draftsmith:spec_decode") or sample.name == "draftsmith:generation_tokens_total":
                key = sample.name + (f"[{sample.labels['position']}]" if "position" in sample.labels else "")
                counters[key] = sample.value
    return counters


def run(args: argparse.Namespace) -> int:
    from openai import OpenAI

    model = Path(args.model) if args.model else default_demo_model()
    if not model.is_dir():
        raise DraftsmithError(f"demo model {model} not found; pass --model DIR")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = Path(tempfile.mkdtemp(prefix="draftsmith-demo-")) / "server.log"
    spec = demo_speculation(model)
    command = [sys.executable, "-m", "draftsmith", "serve", str(model), "--port", str(port), "--served-model-name",
               "demo", "--device", args.device, "--speculative-config", json.dumps(spec)]
    print("$ draftsmith serve", model, "--port", port, "--speculative-config", f"'{json.dumps(spec)}'", flush=True)
    with log.open("w") as log_file:
        proc = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT)
    try:
        wait_healthy(url, proc, log)
        client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        start, generated = time.perf_counter(), 0
        for prompt in DEMO_PROMPTS[:-1]:
            out = client.completions.create(model="demo", prompt=prompt, max_tokens=args.max_tokens, temperature=0)
            generated += out.usage.completion_tokens
            print("=" * 78)
            print(prompt + out.choices[0].text)
        print("=" * 78 + "\n(streamed)")
        print(DEMO_PROMPTS[-1], end="", flush=True)
        stream = client.completions.create(model="demo", prompt=DEMO_PROMPTS[-1], max_tokens=args.max_tokens,
                                           temperature=0, stream=True, stream_options={"include_usage": True})
        for chunk in stream:
            if chunk.choices:
                print(chunk.choices[0].text, end="", flush=True)
            if chunk.usage:
                generated += chunk.usage.completion_tokens
        elapsed = time.perf_counter() - start
        print("\n" + "=" * 78)
        c = _spec_counters(url)
        drafts = c.get("draftsmith:spec_decode_num_drafts_total", 0)
        accepted = c.get("draftsmith:spec_decode_num_accepted_tokens_total", 0)
        per_pos = [c.get(f"draftsmith:spec_decode_num_accepted_tokens_per_pos_total[{i}]", 0) / max(drafts, 1)
                   for i in range(spec["num_speculative_tokens"])]
        print(f"{len(DEMO_PROMPTS)} requests, {generated} tokens in {elapsed:.2f} s = {generated / elapsed:.1f} tokens/s "
              "(client side, sequential)")
        print(f"speculation ({spec['method']}, k={spec['num_speculative_tokens']}): {drafts:.0f} drafts, "
              f"{c.get('draftsmith:spec_decode_num_draft_tokens_total', 0):.0f} draft tokens, {accepted:.0f} accepted; "
              f"mean acceptance length {1 + accepted / max(drafts, 1):.2f}; per position "
              + " / ".join(f"{p:.2f}" for p in per_pos))
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
    print("server stopped")
    return 0
