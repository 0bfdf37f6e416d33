"""`draftsmith capture --engine vllm` against the real vLLM CPU build in build/peer-vllm (`make peer-vllm`): vLLM's
hidden states, through its extract_hidden_states method and draftsmith's connector, are stored as draftsmith's
own capture stores them, and the trainer reads the same samples from both within bf16 rounding. Skipped where
the venv is not built (`make test` builds it where vLLM installs). The flag checks run without vLLM."""

import json

import pytest
import torch
import yaml

from draftsmith.cli import main
from draftsmith.train.capture import CapturedDataset
from helpers import DEMO_MODEL
from vllm_oracle import INSTALLED

CODE = ["def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n" * 3,
        "import os\n\n\nclass Cache:\n    def __init__(self, root):\n        self.root = root\n\n    def path(self, key):\n"
        "        return os.path.join(self.root, key)\n",
        "for i in range(10):\n    if i % 2:\n        print(i)\n"]
# the embeddings, a middle layer, and the last one, whose HF hidden state has the final norm applied and vLLM's not
LAYERS = [0, 3, 6]


@pytest.fixture
def restore_threads():
    """--engine vllm binds vLLM to torch's thread count and sets it: the tests after this one get theirs back."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _recipe(tmp_path) -> str:
    data = tmp_path / "code.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in CODE))
    recipe = {"model": {"target": str(DEMO_MODEL), "head_type": "eagle3", "aux_layer_ids": LAYERS,
                        "draft_vocab_size": 512},
              "data": {"train_files": [str(data)], "format": "text", "max_length": 48, "eval_fraction": 0},
              "training": {"output_dir": str(tmp_path / "run"), "epochs": 1, "batch_size": 1, "learning_rate": 3e-3,
                           "warmup_ratio": 0.0, "eval_max_k": 4, "ttt_length": 2, "seed": 0,
                           "log_every_steps": 1}}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return str(path)


@pytest.mark.slow
@pytest.mark.skipif(not INSTALLED.is_file(), reason=f"{INSTALLED} not found: `make peer-vllm` builds vLLM's CPU build there")
def test_vllm_hidden_states_read_as_draftsmiths_within_bf16(tmp_path, restore_threads):
    recipe = _recipe(tmp_path)
    for engine, extra in (("draftsmith", ()), ("vllm", ("--enforce-eager",))):  # eager: starts in seconds
        assert main(["capture", recipe, "--output", str(tmp_path / engine), "--samples-per-shard", "2",
                     "--engine", engine, *extra]) == 0
    ours, theirs = (CapturedDataset(tmp_path / engine, tuple(LAYERS)) for engine in ("draftsmith", "vllm"))
    assert len(ours) == len(theirs) == len(CODE)
    for i in range(len(ours)):
        mine, vllm = ours[i], theirs[i]
        assert vllm["input_ids"] == mine["input_ids"] and vllm["loss_mask"] == mine["loss_mask"]
        for key in ("features", "last"):
            assert vllm[key].dtype == mine[key].dtype == torch.bfloat16
            # each value within one bf16 rounding step of ours (its relative spacing is 2^-8 .. 2^-7)
            torch.testing.assert_close(vllm[key].float(), mine[key].float(), rtol=2**-7, atol=1e-3)
    # the last layer is the normed one: unnormed, the demo model's runs to about 20 where the norm keeps it near 1
    assert ours[0]["last"].float().abs().mean() < 2
    # a head trained one epoch on each capture, with one seed, learns alike: the same losses step by step (to
    # 1e-3: features within a bf16 step) and the same acceptance on the same eval text
    losses, reports = {}, {}
    for engine in ("draftsmith", "vllm"):
        out = tmp_path / f"run-{engine}"
        assert main(["train", recipe, f"data.hidden_states_dir={tmp_path / engine}", f"training.output_dir={out}",
                     f"data.eval_files=[{tmp_path / 'code.jsonl'}]", "--no-check"]) == 0
        losses[engine] = [json.loads(line)["loss"] for line in (out / "train_log.jsonl").read_text().splitlines()]
        reports[engine] = json.loads((out / "eval_epoch1.json").read_text())
    assert len(losses["vllm"]) == len(CODE)
    torch.testing.assert_close(losses["vllm"], losses["draftsmith"], rtol=1e-3, atol=0)
    key = "sim_mean_acceptance_length_k4"
    assert abs(reports["draftsmith"][key] - reports["vllm"][key]) < 0.05


def test_vllm_flags_need_vllm_and_vllm_needs_its_venv(tmp_path, capsys):
    recipe = _recipe(tmp_path)
    common = ["capture", recipe, "--output", str(tmp_path / "out")]
    assert main([*common, "--tensor-parallel-size", "2", "--enforce-eager", "--max-num-seqs", "8"]) == 2
    assert "--tensor-parallel-size, --enforce-eager, --max-num-seqs: vLLM's, for --engine vllm" in capsys.readouterr().err
    assert main([*common, "--engine", "vllm", "--vllm-python", str(tmp_path / "none" / "python")]) == 2
    assert "make peer-vllm" in capsys.readouterr().err
