"""vLLM's side of `draftsmith datagen --engine vllm`: the target loaded once in vLLM's offline `LLM`, then one
batch of prompts generated per command.

It runs with the vLLM venv's python, by file path: that venv has vLLM and no draftsmith, so this file imports
only vLLM (inside `main`) and the standard library. Usage:

    build/peer-vllm/bin/python vllm_datagen_worker.py JOB.json

The job (written by `serve/apps/vllm_generator.py`): model, dtype, max_model_len, max_num_seqs, seed,
tensor_parallel_size, enforce_eager. Prompts arrive as token ids, templated and tokenized by draftsmith,
so both engines see the same ids. The worker speaks in lines on stdout that begin with the peer's PREFIX (anything else
there is vLLM's own output; `vllm_peer_worker.say` writes them): first {"ready": {"vllm_version", "startup_s"}} or {"refused": reason}; then,
for each line {"prompts": [[ids]], "sampling": {temperature, top_p, max_tokens, seed}} on stdin,
{"outputs": [{"text", "token_ids"}]} in prompt order, or {"failed": reason}. Reasons are one line.
"""

from __future__ import annotations

import sys
from pathlib import Path

# the bench's peer worker speaks the same protocol and, like this file, imports only the standard library
# until vLLM is loaded: its command loop serves both (run by path: its folder goes on the path)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from vllm_peer_worker import answer_commands  # noqa: E402


def load(job: dict):
    from vllm import LLM

    return LLM(job["model"], dtype=job["dtype"], max_model_len=job["max_model_len"], max_num_seqs=job["max_num_seqs"],
               tensor_parallel_size=job["tensor_parallel_size"],
               enforce_eager=job["enforce_eager"], enable_prefix_caching=False, seed=job["seed"])


def generate(llm, command: dict) -> list[dict]:
    from vllm import SamplingParams

    sampling = command["sampling"]
    # every request with the same settings, seed included, as datagen hands draftsmith's engine one
    # SamplingParams for all of them
    params = SamplingParams(temperature=sampling["temperature"], top_p=sampling["top_p"],
                            max_tokens=sampling["max_tokens"], seed=sampling.get("seed"))
    prompts = [{"prompt_token_ids": ids} for ids in command["prompts"]]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [{"text": out.outputs[0].text, "token_ids": list(out.outputs[0].token_ids)} for out in outputs]


def main(argv: list[str]) -> int:
    return answer_commands(argv, load, generate, "outputs")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
