"""The offline API, shaped like vLLM's `LLM`: load once, `generate` many prompts with continuous batching."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from tqdm.auto import tqdm

from draftsmith.errors import DraftsmithError
from draftsmith.models.llama import CausalLM
from draftsmith.models.loader import load_target
from draftsmith.models.tokenizer import eos_token_ids, load_tokenizer
from draftsmith.serve.client.frontend import Frontend, PromptInput
from draftsmith.serve.engine.core import EngineConfig, LLMEngine
from draftsmith.serve.engine.host_memory import keep_freed_memory
from draftsmith.serve.engine.outputs import OutputCollector, RequestOutput
from draftsmith.serve.engine.sampling_params import SamplingParams
from draftsmith.serve.speculation.config import from_legacy_kwargs, parse_speculative_config

LEGACY_SPEC_KWARGS = ("speculative_model", "num_speculative_tokens", "ngram_prompt_lookup_max",
                      "ngram_prompt_lookup_min")

logger = logging.getLogger("draftsmith")



class LLM(Frontend):
    """A target model plus engine.

    Args:
        model: HF model directory (config.json, safetensors, tokenizer).
        dtype: "auto" (fp32 on CPU, the checkpoint's dtype on GPU), "float32", "bfloat16" or "float16".
        device: "cpu", "cuda" or None (CUDA when available).
        speculative_config: vLLM-style speculation settings: a dict, JSON string or `SpeculativeConfig`,
            e.g. {"method": "ngram", "num_speculative_tokens": 4}. The deprecated keyword forms
            speculative_model="[ngram]", num_speculative_tokens=, ngram_prompt_lookup_max= still work.
        max_num_seqs: requests decoding at once; also the number of KV cache slots.
        max_model_len: prompt + output tokens per request; defaults to the model's context.
        logprobs_mode: "raw_logprobs" (log_softmax of the logits) or "processed_logprobs" (after temperature,
            top-k and top-p), for requests with SamplingParams.logprobs.
        target: the target model another LLM of the same `model` already loaded (`llm.model`), to share
            instead of loading again: serving only reads its weights. The bench runs every method on one
            copy, so that no method's forwards differ from another's by where its weights sit in memory.
        enforce_eager, step_mode: how decode and verify forwards run (`serve.engine.step_graphs`): by default as
            captured CUDA graphs on CUDA and eagerly on CPU; enforce_eager (vLLM's name) keeps them eager.
        profile_steps: time each decode step's parts on the device (`get_metrics()["step_profile"]`): on CUDA
            that synchronises several times a step, so it is off unless asked (an adaptive policy times its
            steps anyway).
        skip_tokenizer_init: load no tokenizer (vLLM's name): prompts are token ids and outputs have no text (a
            model folder of config.json alone, as `draftsmith bench --shape` builds with random weights).
    """

    def __init__(self, model: str | Path, dtype: str = "auto", device: str | None = None,
                 speculative_config: dict | str | None = None, max_num_seqs: int = 16,
                 max_model_len: int | None = None, max_num_batched_tokens: int = 2048, seed: int = 0,
                 target: CausalLM | None = None, logprobs_mode: str = "raw_logprobs", skip_tokenizer_init: bool = False,
                 enforce_eager: bool = False, step_mode: str = "auto", profile_steps: bool = False,
                 **legacy_speculation):
        unknown = set(legacy_speculation) - set(LEGACY_SPEC_KWARGS)
        if unknown:
            raise TypeError(f"LLM() got unexpected keyword arguments {sorted(unknown)}")
        legacy = from_legacy_kwargs(**legacy_speculation)
        if legacy is not None and speculative_config is not None:
            raise DraftsmithError("pass speculative_config or the legacy speculative_model=..., not both")
        spec_config = parse_speculative_config(legacy or speculative_config)
        model_dir = Path(model)
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise DraftsmithError(f"device {device!r} requested but CUDA is not available")
        if max_num_seqs < 1:
            raise DraftsmithError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        if device == "cpu":
            keep_freed_memory()  # before the weights and caches: see host_memory
        if target is None:
            target = load_target(model_dir, dtype=dtype, device=device, max_len=max_model_len)
        else:
            where, wanted = target.model.embed_tokens.weight.device, torch.device(device)
            if where.type != wanted.type or wanted.index not in (None, where.index):  # "cuda" means cuda:0 here
                raise DraftsmithError(f"target= is on {where}, not {device!r}")
        self.model = target
        context = self.model.config.max_position_embeddings
        max_model_len = max_model_len or context
        if not 1 < max_model_len <= context:
            raise DraftsmithError(f"max_model_len must be in [2, {context}] (the model's context), got {max_model_len}")
        tokenizer = None if skip_tokenizer_init else load_tokenizer(model_dir)
        super().__init__(model_dir, tokenizer, max_model_len, self.model.config.vocab_size, max_num_seqs)
        cost_table = None
        if spec_config is not None and spec_config.adaptive:
            cost_table = self._forward_costs(model_dir)
        self.engine = LLMEngine(
            self.model, self.tokenizer,
            EngineConfig(max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                         max_num_batched_tokens=max(max_num_batched_tokens, 1), seed=seed,
                         logprobs_mode=logprobs_mode, step_mode=step_mode, enforce_eager=enforce_eager,
                         profile_steps=profile_steps),
            eos_token_ids(model_dir, self.model.config.eos_token_ids, self.tokenizer),
            spec_config, cost_table,
        )

    def _forward_costs(self, model_dir: Path):
        """The target's forward cost table for adaptive speculation: from the disk cache, or measured now
        (a few seconds, once per model, device, dtype and torch version)."""
        from draftsmith.serve.speculation.cost_profile import cache_path, load_or_profile

        table, cached = load_or_profile(self.model, model_dir)
        if not cached:
            logger.info("profiled target forwards for adaptive speculation; saved to %s", cache_path(table.key))
        return table

    def generate(self, prompts: PromptInput | Sequence[PromptInput],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Runs every prompt to completion and returns outputs in input order."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise DraftsmithError(f"{len(prompts)} prompts but {len(params)} sampling params")
        # Encode and check every prompt before queueing any, so one bad prompt leaves the engine untouched.
        checked = []
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            try:
                text, ids = self.encode(prompt)
                checked.append(self.check(ids, p, text))
            except DraftsmithError as exc:
                raise DraftsmithError(f"prompt {i}: {exc}") from None
        order = {self.engine.add(request).request_id: i for i, request in enumerate(checked)}
        results: list[RequestOutput | None] = [None] * len(prompts)
        collector, start, generated = OutputCollector(), time.perf_counter(), 0
        with tqdm(total=len(prompts), desc="generate", unit="req", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished_requests():
                for output in collector.add_all(self.engine.step()):
                    if output.finished:
                        results[order[output.request_id]] = output
                        generated += sum(len(c.token_ids) for c in output.outputs)
                        bar.update(1)
                        bar.set_postfix(tok_s=f"{generated / (time.perf_counter() - start):.1f}")
        return results  # type: ignore[return-value]

    def chat(self, messages: list[list[dict[str, str]]], sampling_params=None, use_tqdm: bool = True):
        return self.generate([self.apply_chat_template(m) for m in messages], sampling_params, use_tqdm)

    def get_metrics(self) -> dict[str, float]:
        return self.engine.get_metrics()


def engine_kwargs(args) -> dict:
    """LLM keyword arguments from the engine flags every command shares (`draftsmith.cli._add_engine_args`)."""
    return {"dtype": args.dtype, "device": args.device, "speculative_config": args.speculative_config,
            "max_num_seqs": args.max_num_seqs, "max_model_len": args.max_model_len,
            "logprobs_mode": args.logprobs_mode, "enforce_eager": args.enforce_eager, "step_mode": args.step_mode}
