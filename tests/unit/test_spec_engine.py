"""Speculation inside the engine: lossless greedy, consistent cache, metrics that add up."""

import json

import pytest

from draftsmith.cli import main
from draftsmith.serve import LLM, SamplingParams
from helpers import DEMO_MODEL, spec_config

PROMPTS = [
    "def add(a, b):\n    return a",
    "import numpy as np\n\n\ndef normalize(x):\n    mean = x.mean(axis=0)\n    std = x.std(axis=0)\n    return (x - mea",
    "class Node:\n    def __init__(self, value, children=None):\n        self.value = value\n        self.children = chi",
    "for i in ra",
    "def parse_args():\n    parser = argparse.ArgumentParser()\n    parser.add_argument('--lr', type=float)\n    parser.add_argument('--",
    "x = 1\ny = 2\nz = 3\nx = 1\ny = ",
]
GREEDY = SamplingParams(temperature=0, max_tokens=48)


def _spec_llm(k, **extra):
    # fixed k: these tests are about verifying k drafts; adaptive k (which may draft nothing on a slow
    # machine) has its own tests in test_adaptive.py
    config = spec_config("ngram", k=k, prompt_lookup_min=1, prompt_lookup_max=3, **extra)
    return LLM(DEMO_MODEL, dtype="float32", device="cpu", max_num_seqs=4, max_model_len=512,
               speculative_config=config)


@pytest.fixture(scope="module")
def reference_ids():
    llm = LLM(DEMO_MODEL, dtype="float32", device="cpu", max_num_seqs=4, max_model_len=512)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("k", [1, 3, 6])
def test_greedy_equality_with_ngram(k, reference_ids):
    llm = _spec_llm(k)
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)  # 6 prompts on 4 slots: mixed batches
    assert [o.outputs[0].token_ids for o in outputs] == reference_ids
    metrics = llm.get_metrics()
    assert metrics["num_accepted_tokens"] > 0  # speculation really happened
    assert sum(metrics["accepted_per_position"]) == metrics["num_accepted_tokens"]
    assert metrics["accepted_per_position"] == sorted(metrics["accepted_per_position"], reverse=True)
    assert metrics["accepted_per_position"][0] <= metrics["num_drafts"]
    assert metrics["num_draft_tokens"] <= k * metrics["num_drafts"]
    drafted = metrics["drafted_per_position"]  # drafts reaching each position: the per-position denominators
    assert sum(drafted) == metrics["num_draft_tokens"] and drafted[0] == metrics["num_drafts"]
    assert drafted == sorted(drafted, reverse=True)
    assert all(a <= d for a, d in zip(metrics["accepted_per_position"], drafted))
    assert metrics["mean_acceptance_length"] == pytest.approx(
        1 + metrics["num_accepted_tokens"] / metrics["num_drafts"])
    # fewer target forwards than tokens: each verify forward kept more than one token on average
    assert metrics["num_forward_passes"] < metrics["num_generated_tokens"]


@pytest.mark.slow
def test_seeded_sampling_with_speculation_repeats_and_respects_limits():
    llm = _spec_llm(4)
    params = [SamplingParams(temperature=0.7, top_p=0.9, seed=s, max_tokens=20 + s) for s in range(len(PROMPTS))]
    first = llm.generate(PROMPTS, params, use_tqdm=False)
    alone = [llm.generate(p, sp, use_tqdm=False)[0] for p, sp in zip(PROMPTS, params)]
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in alone]
    for out, sp in zip(first, params):
        assert len(out.outputs[0].token_ids) <= sp.max_tokens


def test_synthetic_acceptance_rate_is_honoured():
    rate = 0.5
    llm = _spec_llm(3, rejection_sample_method="synthetic", synthetic_acceptance_rate=rate)
    llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True), use_tqdm=False)
    m = llm.get_metrics()
    first_position = m["accepted_per_position"][0] / m["num_drafts"]
    assert abs(first_position - rate) < 0.12, m


def test_generate_cli_reports_speculation_metrics(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS[:3]))
    argv = ["generate", "--model", str(DEMO_MODEL), "--prompts", str(prompts), "--output", str(tmp_path / "o.jsonl"),
            "--max-tokens", "24", "--temperature", "0", "--device", "cpu", "--metrics-json", str(tmp_path / "m.json"),
            "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}']
    assert main(argv) == 0
    metrics = json.loads((tmp_path / "m.json").read_text())
    for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "accepted_per_position",
                "mean_acceptance_length"):
        assert key in metrics
    assert len(metrics["accepted_per_position"]) == 3
    bad = argv[:-1] + ['{"method": "ngram", "num_speculative_tokens": 3, "lookup": 2}']
    assert main(bad) == 2
