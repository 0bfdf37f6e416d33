"""`draftsmith datagen --engine vllm` against the real vLLM CPU build in build/peer-vllm (`make peer-vllm`): the
same records regenerated greedily by both engines give the same text, chat turns and code continuations
alike. Skipped where the venv is not built (`make test` builds it where vLLM installs). The flag checks run
without vLLM."""

import json

import pytest
import torch

from draftsmith.cli import main
from helpers import DEMO_MODEL
from vllm_oracle import INSTALLED

CHAT = {"conversations": [
    {"from": "human", "value": "Write a function that adds two numbers."},
    {"from": "gpt", "value": "someone else's answer"},
    {"from": "human", "value": "And one that subtracts."},
    {"from": "gpt", "value": "another foreign answer"}]}
CODE = ["def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n",
        "import os\n\n\nclass Cache:\n    def __init__(self, root):\n        self.root = root\n\n    def path(self, key):\n",
        "for i in range(10):\n    if i % 2:\n        print(i)\n"]


@pytest.fixture
def restore_threads():
    """--engine vllm binds vLLM to torch's thread count and sets it: the tests after this one get theirs back."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _datagen(tmp_path, name: str, records: list[dict], engine: str, *extra: str) -> list[dict]:
    source, out = tmp_path / f"{name}.jsonl", tmp_path / f"{name}-{engine}.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert main(["datagen", "--model", str(DEMO_MODEL), "--input", str(source), "--output", str(out),
                 "--max-tokens", "24", "--temperature", "0", "--device", "cpu", "--engine", engine, *extra]) == 0
    return [json.loads(line) for line in out.read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.skipif(not INSTALLED.is_file(), reason=f"{INSTALLED} not found: `make peer-vllm` builds vLLM's CPU build there")
def test_vllm_regenerates_what_draftsmith_does(tmp_path, capsys, restore_threads):
    for name, records, extra in (("chat", [CHAT], ()), ("code", [{"text": t} for t in CODE], ("--prompt-tokens", "12"))):
        ours = _datagen(tmp_path, name, records, "draftsmith", *extra)
        theirs = _datagen(tmp_path, name, records, "vllm", "--enforce-eager", *extra)  # starts in seconds
        assert theirs == ours
    assert ours[0]["text"] != ours[0]["prompt"]  # something was generated
    printed = capsys.readouterr().out
    assert "vllm: 3 records in" in printed and "samples/s" in printed
    # two data-parallel ranks, a core each, each generating its share: the same records in the same order
    split = _datagen(tmp_path, "code-dp", [{"text": t} for t in CODE], "vllm", "--enforce-eager",
                     "--data-parallel-size", "2", "--prompt-tokens", "12")
    assert split == ours and "2 data-parallel ranks" in capsys.readouterr().out


def test_parallel_sizes_need_vllm_and_vllm_needs_its_venv(tmp_path, capsys):
    source = tmp_path / "code.jsonl"
    source.write_text(json.dumps({"text": CODE[0]}) + "\n")
    common = ["datagen", "--model", str(DEMO_MODEL), "--input", str(source), "--output", str(tmp_path / "out.jsonl")]
    assert main([*common, "--tensor-parallel-size", "2"]) == 2
    assert "--tensor-parallel-size 2 needs --engine vllm" in capsys.readouterr().err
    assert main([*common, "--data-parallel-size", "2"]) == 2
    assert "--data-parallel-size 2 needs --engine vllm" in capsys.readouterr().err
    assert main([*common, "--engine", "vllm", "--vllm-python", str(tmp_path / "none" / "python")]) == 2
    assert "make peer-vllm" in capsys.readouterr().err
    assert main([*common, "--engine", "vllm", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}']) == 2
    assert "--speculative-config is for --engine draftsmith" in capsys.readouterr().err
    assert not (tmp_path / "out.jsonl").exists()
