"""vLLM's CPU build as an independent oracle of the sampling fields: the demo model, greedy, under each of
repetition/presence/frequency_penalty, logit_bias, min_tokens, bad_words and allowed_token_ids, gives the same
ids in vLLM as in draftsmith, speculating (EAGLE-3) or not: the same meaning, order and tokenization of
each. Skipped where vLLM's venv is not built (`make test` builds it, test-only)."""

import json
import os
import subprocess
import tempfile
from pathlib import Path

import pytest

import vllm_oracle as oracle
from draftsmith.serve import LLM, SamplingParams
from helpers import DEMO_MODEL, spec_config

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not oracle.INSTALLED.is_file(),
                                 reason=f"{oracle.INSTALLED} not found: `make peer-vllm` builds vLLM's CPU build there")]
WORKER = Path(__file__).resolve().parents[1] / "vllm_sampling_worker.py"
PREFIX = "@@vllm-sampling@@ "
MAX_TOKENS = 32
CASES = [{"repetition_penalty": 1.3}, {"presence_penalty": 1.5}, {"frequency_penalty": 1.0},
         {"presence_penalty": -1.0, "frequency_penalty": 0.5},
         {"bad_words": ["return", "self.assert", " os.path"]},
         {"allowed_token_ids": list(range(50, 4000))},
         {"repetition_penalty": 1.1, "presence_penalty": 0.3, "bad_words": ["import"], "min_tokens": 8},
         {"min_tokens": 12, "stop": ["\n"]}]  # stop strings wait for min_tokens too


def _vllm_outputs(prompts: list[list[int]], cases: list[dict]) -> list[list[list[int]]]:
    with tempfile.TemporaryDirectory() as workdir:
        job = Path(workdir) / "job.json"
        job.write_text(json.dumps({"model": str(DEMO_MODEL), "max_model_len": 1024, "max_tokens": MAX_TOKENS,
                                   "prompts": prompts, "cases": cases}))
        env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "2",
               "VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
               "TOKENIZERS_PARALLELISM": "false"}
        done = subprocess.run([str(oracle.PEER_PYTHON), str(WORKER), str(job)], env=env, capture_output=True,
                              text=True, timeout=900)
    answers = [line for line in done.stdout.splitlines() if line.startswith(PREFIX)]
    assert answers, f"the vLLM worker gave no answer (status {done.returncode}): {done.stdout[-2000:]}"
    answer = json.loads(answers[-1][len(PREFIX):])
    assert "refused" not in answer, answer["refused"]
    return answer["outputs"]


def _params(case: dict) -> SamplingParams:
    case = {**case, "logit_bias": {int(k): v for k, v in case["logit_bias"].items()}} if "logit_bias" in case else case
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, **case)


def test_vllm_generates_what_draftsmith_does_under_every_sampling_field():
    prompts = oracle.prompts()[:3]
    plain = LLM(DEMO_MODEL, dtype="float32", device="cpu", max_num_seqs=4, max_model_len=1024)
    spec = LLM(DEMO_MODEL, dtype="float32", device="cpu", max_num_seqs=4, max_model_len=1024, target=plain.model,
               speculative_config=spec_config("eagle3", DEMO_MODEL.parent / "demo-code-7m-eagle3", 4,
                                              draft_dtype="float32"))
    unconstrained = [o.outputs[0].token_ids for o in plain.generate(
        [{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)]
    # each prompt's first greedy token pushed down, one token pulled up a little
    # the 4th token of the first answer as a stop token that min_tokens holds back
    cases = [*CASES, {"logit_bias": {**{str(ids[0]): -100 for ids in unconstrained}, "7": 2.5}},
             {"min_tokens": 20, "stop_token_ids": [unconstrained[0][3]]}]
    theirs = _vllm_outputs(prompts, cases)
    for case, vllm_ids in zip(cases, theirs):
        for llm in (plain, spec):
            ours = [o.outputs[0].token_ids for o in llm.generate(
                [{"prompt_token_ids": p} for p in prompts], _params(case), use_tqdm=False)]
            assert ours == vllm_ids, case
        assert vllm_ids != unconstrained, case  # the field changes the answer here, so the test can tell
