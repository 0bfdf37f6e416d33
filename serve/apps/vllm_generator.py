"""`draftsmith datagen --engine vllm`: the target's generations from vLLM's offline `LLM`, in a venv of its own.

vLLM pins a transformers apart from ours, so it runs as a subprocess of that venv's python
(`vllm_datagen_worker.py`, started like the bench's peer: `draftsmith.vllm_process.PeerWorker`). draftsmith keeps
the parts that decide what the data is: the chat template and the tokenizer turn every conversation and text
opening into token ids here, and vLLM gets those ids, so both engines see exactly the same prompts. On CPU
vLLM's OpenMP threads are bound to cores 0..N-1 (N: torch's thread count); on CUDA vLLM picks its devices,
with --tensor-parallel-size passed through. --data-parallel-size D runs D workers (vLLM's offline LLM is one
data-parallel rank a process), each on its own --tensor-parallel-size GPUs (CUDA_VISIBLE_DEVICES) or its own
share of the cores, and hands each its contiguous share of every batch; outputs come back in prompt order.
--enforce-eager is vLLM's own flag: without it vLLM compiles its forward at start, then runs faster.
"""

from __future__ import annotations

import json
import os
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
from draftsmith.vllm_process import DEFAULT_PYTHON, PeerWorker, bind_threads, cores_of, split_cores

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
                 tensor_parallel_size: int = 1, seed: int | None = None, enforce_eager: bool = False,
                 data_parallel_size: int = 1):
        python = Path(python) if python else DEFAULT_PYTHON
        if not python.is_file():
            raise DraftsmithError(f"--engine vllm: {python} not found; run `make peer-vllm` (vLLM in its own venv) "
                                  "or pass --vllm-python")
        self.model_dir = Path(model)
        self.tokenizer = load_tokenizer(self.model_dir)
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")  # as draftsmith's engine picks
        ranks = data_parallel_size
        if device == "cpu":
            binds = split_cores(bind_threads(None)[1], ranks)
            threads, envs = [len(cores_of(b)) for b in binds], [None] * ranks
        else:
            binds, threads, envs = [None] * ranks, [0] * ranks, _gpu_groups(ranks, tensor_parallel_size)
        config = self.model_dir / "config.json"
        if not config.is_file():
            raise DraftsmithError(f"--engine vllm: {config} not found (vLLM loads an HF model folder)")
        context = json.loads(config.read_text()).get("max_position_embeddings")
        self.max_model_len = max_model_len or min(DEFAULT_MAX_MODEL_LEN, context or DEFAULT_MAX_MODEL_LEN)
        job = {"model": str(self.model_dir.resolve()), "dtype": "float32" if dtype == "auto" and device == "cpu" else dtype,
               "max_model_len": self.max_model_len, "max_num_seqs": max_num_seqs,
               "tensor_parallel_size": tensor_parallel_size, "enforce_eager": enforce_eager}
        # kept where vLLM fails, so that the log an error names is still there (`close`)
        self.workdir = Path(tempfile.mkdtemp(prefix="draftsmith-datagen-vllm-"))
        started = time.perf_counter()
        # each rank its own engine seed: requests without a seed of their own would otherwise draw alike on
        # every rank (with --seed every request has that seed, on any rank, as on draftsmith's engine)
        self.workers = []
        try:
            for rank in range(ranks):
                self.workers.append(PeerWorker(python, {**job, "seed": (seed or 0) + rank}, binds[rank],
                                               threads[rank], self.workdir / f"rank{rank}", worker=WORKER,
                                               env=envs[rank]))
        except BaseException:
            self.close(keep_log=True)
            raise
        for worker in self.workers:  # they load at once
            ready = worker.reply()
            if "ready" not in ready:
                self.close(keep_log=True)
                raise DraftsmithError(f"vLLM would not load {self.model_dir}: {ready.get('refused', ready)}; "
                                      f"its log: {worker.log_path}")
        self.version = ready["ready"]["vllm_version"]
        print(f"vLLM {self.version} loaded {self.model_dir.name} in {time.perf_counter() - started:.0f} s"
              + (f" ({ranks} data-parallel ranks)" if ranks > 1 else ""))

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
        batch_size = BATCH * len(self.workers)
        with tqdm(total=len(prompts), desc="generate (vLLM)", unit="req") as bar:
            for first in range(0, len(prompts), batch_size):
                batch = [list(p["prompt_token_ids"]) for p in prompts[first : first + batch_size]]
                reply = self._command(batch, sampling)
                done = [GeneratedOutput([Completion(o["text"], o["token_ids"])]) for o in reply]
                outputs += done
                tokens += sum(len(o.outputs[0].token_ids) for o in done)
                bar.update(len(batch))
                bar.set_postfix(tok_per_s=f"{tokens / (time.perf_counter() - started):.0f}")
        seconds = time.perf_counter() - started
        print(f"vLLM generated {len(outputs)} samples, {tokens} tokens in {seconds:.1f} s "
              f"({len(outputs) / seconds:.2f} samples/s, {tokens / seconds:.0f} tok/s)")
        return outputs

    def _command(self, batch: list[list[int]], sampling: dict) -> list[dict]:
        """`batch` cut into one contiguous share a rank, all ranks at once -> the outputs in batch order."""
        share = -(-len(batch) // len(self.workers))
        busy = []
        for rank, worker in enumerate(self.workers):
            if batch[rank * share:(rank + 1) * share]:
                worker.post({"prompts": batch[rank * share:(rank + 1) * share], "sampling": sampling})
                busy.append(worker)
        outputs = []
        for worker in busy:
            reply = worker.reply()
            if "outputs" not in reply:
                raise DraftsmithError(f"vLLM failed a batch: {reply.get('failed', reply)}; its log: {worker.log_path}")
            outputs += reply["outputs"]
        return outputs

    def close(self, keep_log: bool = False) -> None:
        """Stops vLLM; its folder (jobs and logs) is removed unless `keep_log` (a failure that names a log)."""
        for worker in self.workers:
            worker.close()
        if not keep_log:
            shutil.rmtree(self.workdir, ignore_errors=True)


def _gpu_groups(ranks: int, tensor_parallel_size: int) -> list[dict[str, str] | None]:
    """Each data-parallel rank's CUDA_VISIBLE_DEVICES: its own tensor_parallel_size of the visible GPUs."""
    if ranks == 1:
        return [None]  # vLLM picks its devices
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    devices = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
    if ranks * tensor_parallel_size > len(devices):
        raise DraftsmithError(f"--data-parallel-size {ranks} x --tensor-parallel-size {tensor_parallel_size} needs "
                              f"{ranks * tensor_parallel_size} GPUs; {len(devices)} visible")
    return [{"CUDA_VISIBLE_DEVICES": ",".join(devices[r * tensor_parallel_size:(r + 1) * tensor_parallel_size])}
            for r in range(ranks)]
