"""`draftsmith generate` greedy output equals transformers' greedy `generate`, token for token, fp32."""

import json

import pytest
import torch

from draftsmith.cli import main
from draftsmith.corpus import code_prompts
from helpers import DEMO_MODEL, shared_path

MAX_TOKENS = 48


def _hf_greedy(model_dir, prompts):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    results = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False).input_ids
            out = model.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=tokenizer.pad_token_id)
            results.append(out[0, ids.shape[1]:].tolist())
    return results


def _cli_greedy(model_dir, prompts, tmp_path):
    prompts_file = tmp_path / "prompts.jsonl"
    prompts_file.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    out_file = tmp_path / "out.jsonl"
    assert main(["generate", "--model", str(model_dir), "--prompts", str(prompts_file), "--output", str(out_file),
                 "--max-tokens", str(MAX_TOKENS), "--temperature", "0", "--dtype", "float32", "--device", "cpu"]) == 0
    return [json.loads(line)["token_ids"] for line in out_file.read_text().splitlines()]


@pytest.mark.parametrize("model", ["demo", "house"])
def test_generate_matches_transformers_on_validation_code(model, tmp_path):
    data = shared_path("data", "code-validation.jsonl.xz")
    model_dir = DEMO_MODEL if model == "demo" else shared_path("models", "house-code-28m")
    prompts = code_prompts(data, num_prompts=6)
    ours = _cli_greedy(model_dir, prompts, tmp_path)
    reference = _hf_greedy(model_dir, prompts)
    assert ours == reference
    assert sum(len(r) for r in reference) > 3 * MAX_TOKENS  # the comparison covers real generations
