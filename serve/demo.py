"""`draftsmith demo`: the main job on the embedded demo model, for a newcomer's first minute."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from draftsmith.errors import DraftsmithError
from draftsmith.serve.llm import LLM
from draftsmith.serve.sampling_params import SamplingParams

DEMO_PROMPTS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fib",
    "import os\n\n\ndef list_python_files(root):\n    result = []\n    for dirpath, _, names in os.wa",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n        self.it",
    "def read_json(path):\n    with open(path) as f:\n        return json.lo",
]


def default_demo_model() -> Path:
    # The repo root holds assets/; an editable install keeps the package beside it.
    return Path(__file__).resolve().parents[1] / "assets" / "demo-code-7m"


def run(args: argparse.Namespace) -> int:
    model = Path(args.model) if args.model else default_demo_model()
    if not model.is_dir():
        raise DraftsmithError(f"demo model {model} not found; pass --model DIR")
    llm = LLM(model, dtype="float32", device=args.device)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    start = time.perf_counter()
    outputs = llm.generate(DEMO_PROMPTS, params)
    elapsed = time.perf_counter() - start
    for prompt, out in zip(DEMO_PROMPTS, outputs):
        print("=" * 78)
        print(prompt + out.outputs[0].text)
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    print("=" * 78)
    print(f"batched greedy generation: {len(outputs)} prompts, {generated} tokens in {elapsed:.2f} s "
          f"= {generated / elapsed:.1f} tokens/s on {llm.engine.device}")
    return 0
