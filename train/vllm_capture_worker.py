"""vLLM's side of `draftsmith capture --engine vllm`: the target loaded once in vLLM's offline `LLM` with its
`extract_hidden_states` speculative method, then the hidden states of one batch of samples per command.

It runs with the vLLM venv's python, by file path: that venv has vLLM and no draftsmith, so this file imports
only vLLM (inside `load` and `capture`) and the standard library. Usage:

    build/peer-vllm/bin/python vllm_capture_worker.py JOB.json

The job (written by `train/vllm_capture.py`): model, dtype, max_model_len, max_num_seqs, tensor_parallel_size,
enforce_eager, layers (hidden-state indices, sorted: 0 the embeddings, i the output of layer i, unnormed)
and storage (the folder the connector writes to). The worker speaks in lines on stdout that begin with the
bench peer's PREFIX (`vllm_peer_worker.say`): first {"ready": {"vllm_version", "startup_s"}} or
{"refused": reason}; then, for each line {"prompts": [[ids]]} on stdin, {"paths": [file]} in prompt order
(safetensors: `hidden_states` [tokens, layers, hidden], `token_ids`; each with a `.lock` beside it that is
held until the file is whole), or {"failed": reason}. Reasons are one line.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
# the bench's peer worker speaks the same protocol and, like this file, imports only the standard library
# until vLLM is loaded: its command loop serves both (run by path: its folder goes on the path). The connector
# sits beside this file, whose folder is first on the path when it runs by path
sys.path.insert(0, str(HERE.parent / "serve" / "bench"))
from vllm_peer_worker import answer_commands  # noqa: E402

CONNECTOR_MODULE = "vllm_hidden_states_connector"


def load(job: dict):
    # vLLM imports the connector by module name, here and in the processes it starts on GPUs
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))
    from vllm import LLM

    spec = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": job["layers"]}}}
    transfer = {"kv_connector": "DraftsmithHiddenStatesConnector", "kv_connector_module_path": CONNECTOR_MODULE,
                "kv_role": "kv_producer", "kv_connector_extra_config": {"shared_storage_path": job["storage"]}}
    return LLM(job["model"], dtype=job["dtype"], max_model_len=job["max_model_len"], max_num_seqs=job["max_num_seqs"],
               tensor_parallel_size=job["tensor_parallel_size"], enforce_eager=job["enforce_eager"],
               enable_prefix_caching=False, seed=0, speculative_config=spec, kv_transfer_config=transfer)


def capture(llm, command: dict) -> list[str]:
    from vllm import SamplingParams

    one_token = SamplingParams(max_tokens=1, temperature=0)
    prompts = command["prompts"]
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], one_token, use_tqdm=False)
    paths = [out.kv_transfer_params["hidden_states_path"] for out in outputs]
    # the connector hears that a request finished with the next engine step's metadata, and only then writes
    # its hidden states: one more one-token request runs that step for the batch's last requests
    llm.generate([{"prompt_token_ids": prompts[0][:1]}], one_token, use_tqdm=False)
    return paths


def main(argv: list[str]) -> int:
    return answer_commands(argv, load, capture, "paths")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
