"""vLLM's CPU build generating with the sampling fields of issue #41, for `tests/integration/test_vllm_sampling.py`:
run in vLLM's venv by path, as the bench's peer worker is,

    build/peer-vllm/bin/python tests/vllm_sampling_worker.py JOB.json

JOB: {"model", "max_model_len", "max_tokens", "prompts": [[ids]], "cases": [{SamplingParams fields}]}. Prints one
line, the PREFIX then JSON {"outputs": [[ids of each prompt] for each case]} or {"refused": why}; greedy, so
that the ids are the engine's and nothing is drawn.
"""

from __future__ import annotations

import json
import sys

PREFIX = "@@vllm-sampling@@ "


def main(argv: list[str]) -> int:
    job = json.loads(open(argv[0]).read())
    try:
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        llm = LLM(job["model"], dtype="float32", enforce_eager=True, max_model_len=job["max_model_len"],
                  enable_prefix_caching=False, max_num_seqs=4, seed=0)
        outputs = []
        for case in job["cases"]:
            if "logit_bias" in case:  # JSON keys are text; vLLM's SamplingParams takes token ids
                case = {**case, "logit_bias": {int(k): v for k, v in case["logit_bias"].items()}}
            params = SamplingParams(temperature=0, max_tokens=job["max_tokens"], **case)
            answers = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in job["prompts"]], params,
                                   use_tqdm=False)
            outputs.append([list(a.outputs[0].token_ids) for a in answers])
    except Exception as exc:  # vLLM refuses with many exception types
        print("\n" + PREFIX + json.dumps({"refused": f"{type(exc).__name__}: {str(exc)[:300]}"}), flush=True)
        return 0
    print("\n" + PREFIX + json.dumps({"outputs": outputs}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
