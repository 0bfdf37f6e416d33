"""`draftsmith datagen --engine vllm`: the target's generations from vLLM's offline `LLM`, in a venv of its own.

vLLM pins a transformers apart from ours, so it runs as a subprocess of that venv's python
(`vllm_datagen_worker.py`, started like the bench's peer: `draftsmith.vllm_process.PeerWorker`). draftsmith keeps
the parts that decide what the data is: the chat template and the tokenizer turn every conversation and text
opening into token ids here, and vLLM gets those ids, so both engines see exactly the same prompts. On CPU
vLLM's OpenMP threads are bound to cores 0..N-1 (N: torch's thread count); on CUDA vLLM picks its devices,
with --tensor-parallel-size passed through (vLLM's offline LLM runs one data-parallel rank per process:
shard the records over processes with --skip-samples and --num-samples). --enforce-eager is vLLM's own flag:
without it vLLM compiles its forward at start, then runs faster.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from draftsmith.errors import DraftsmithError
from draftsmith.models.tokenizer import load_tokenizer
from draftsmith.serve.engine.sampling_params import SamplingParams
from draftsmith.vllm_process import DEFAULT_PYTHON, PeerWorker, bind_threads

WORKER = Path(__file__).with_name("vllm_datagen_worker.py")
BATCH = 256  # prompts per command, so that the progress bar moves
# without --max-model-len, at most this (vLLM would size its KV cache for the model's whole context)
DEFAULT_MAX_MODEL_LEN = 4096


@dataclass
class Completion:
    text: str
    token_ids: list[int]


@dataclass
class GeneratedOutput:
    """What datagen reads of an engine's output: `outputs[0].text` (as draftsmith's RequestOutput)."""

    outputs: list[Completion]


class VllmGenerator:
    """`generate` and `chat` as datagen calls them on draftsmith's `LLM`, run by vLLM."""

    def __init__(self, model: str | Path, python: str | Path | None = None, device: str | None = None,
                 dtype: str = "auto", max_model_len: int | None = None, max_num_seqs: int = 256,
                 tensor_parallel_size: int = 1, seed: int | None = None, enforce_eager: bool = False):
        python = Path(python) if python else DEFAULT_PYTHON
        if not python.is_file():
            raise DraftsmithError(f"--engine vllm: {python} not found; run `make peer-vllm` (vLLM in its own venv) "
                                  "or pass --vllm-python")
        self.model_dir = Path(model)
        self.tokenizer = load_tokenizer(self.model_dir)
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")  # as draftsmith's engine picks
        if device == "cpu":
            threads, bind = bind_threads(None)
        else:
            threads, bind = 0, None
        config = self.model_dir / "config.json"
        if not config.is_file():
            raise DraftsmithError(f"--engine vllm: {config} not found (vLLM loads an HF model folder)")
        context = json.loads(config.read_text()).get("max_position_embeddings")
        self.max_model_len = max_model_len or min(DEFAULT_MAX_MODEL_LEN, context or DEFAULT_MAX_MODEL_LEN)
        job = {"model": str(self.model_dir.resolve()), "dtype": "float32" if dtype == "auto" and device == "cpu" else dtype,
               "max_model_len": self.max_model_len, "max_num_seqs": max_num_seqs,
               "tensor_parallel_size": tensor_parallel_size,
               "seed": 0 if seed is None else seed, "enforce_eager": enforce_eager}
        # kept where vLLM fails, so that the log an error names is still there (`close`)
        self.workdir = Path(tempfile.mkdtemp(prefix="draftsmith-datagen-vllm-"))
        started = time.perf_counter()
        self.worker = PeerWorker(python, job, bind, threads, self.workdir, worker=WORKER)
        ready = self.worker.reply()
        if "ready" not in ready:
            self.close(keep_log=True)
            raise DraftsmithError(f"vLLM would not load {self.model_dir}: {ready.get('refused', ready)}; "
                                  f"its log: {self.worker.log_path}")
        self.version = ready["ready"]["vllm_version"]
        print(f"vLLM {self.version} loaded {self.model_dir.name} in {time.perf_counter() - started:.0f} s")

    def apply_chat_template(self, messages: list[dict]) -> str:
        if not self.tokenizer.chat_template:
            raise DraftsmithError(f"the tokenizer in {self.model_dir} has no chat template")
        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as exc:  # jinja errors on malformed messages
            raise DraftsmithError(f"chat template failed on messages {messages!r}: {exc}") from None

    def chat(self, conversations: list[list[dict]], params: SamplingParams) -> list[GeneratedOutput]:
        prompts = [{"prompt_token_ids": self.tokenizer(self.apply_chat_template(m), add_special_tokens=False).input_ids}
                   for m in conversations]
        return self.generate(prompts, params)

    def generate(self, prompts: Sequence[dict], params: SamplingParams) -> list[GeneratedOutput]:
        """prompts: {"prompt_token_ids": [...]} each -> outputs in prompt order; progress and throughput shown."""
        sampling = {"temperature": params.temperature, "top_p": params.top_p, "max_tokens": params.max_tokens,
                    "seed": params.seed}
        for i, prompt in enumerate(prompts):  # checked before any is sent: one bad prompt wastes no batch
            if len(prompt["prompt_token_ids"]) >= self.max_model_len:
                raise DraftsmithError(f"prompt {i}: {len(prompt['prompt_token_ids'])} tokens leave no room in "
                                      f"--max-model-len {self.max_model_len}")
        outputs: list[GeneratedOutput] = []
        started, tokens = time.perf_counter(), 0
        with tqdm(total=len(prompts), desc="generate (vLLM)", unit="req") as bar:
            for first in range(0, len(prompts), BATCH):
                batch = [list(p["prompt_token_ids"]) for p in prompts[first : first + BATCH]]
                reply = self._command({"prompts": batch, "sampling": sampling})
                done = [GeneratedOutput([Completion(o["text"], o["token_ids"])]) for o in reply]
                outputs += done
                tokens += sum(len(o.outputs[0].token_ids) for o in done)
                bar.update(len(batch))
                bar.set_postfix(tok_per_s=f"{tokens / (time.perf_counter() - started):.0f}")
        seconds = time.perf_counter() - started
        print(f"vLLM generated {len(outputs)} samples, {tokens} tokens in {seconds:.1f} s "
              f"({len(outputs) / seconds:.2f} samples/s, {tokens / seconds:.0f} tok/s)")
        return outputs

    def _command(self, command: dict) -> list[dict]:
        reply = self.worker.send(command)
        if "outputs" not in reply:
            raise DraftsmithError(f"vLLM failed a batch: {reply.get('failed', reply)}; its log: {self.worker.log_path}")
        return reply["outputs"]

    def close(self, keep_log: bool = False) -> None:
        """Stops vLLM; its folder (job and log) is removed unless `keep_log` (a failure that names the log)."""
        self.worker.close()
        if not keep_log:
            shutil.rmtree(self.workdir, ignore_errors=True)
