"""`draftsmith bench --shape NAME --random-weights`: the engine's own speed on a model shape built from its
config alone (nothing downloaded, weights random): ms per token without speculation at each batch size, the
cost of verifying k + 1 tokens against decoding one for k = 1..8, and speculation with a random one-layer
EAGLE-3 head whose drafts are accepted at a set rate (`rejection_sample_method: synthetic`), so that what the
engine spends around a real head's draft cost shows without a trained head.

Each row runs for every `--step-modes` entry side by side (on CUDA: eager and captured CUDA graphs,
`serve.engine.step_graphs`), the verify-cost curve too.

The shapes are the anchors' (`../shared/docs/anchors.md`: Llama-3.1-8B, Qwen3-8B), `tiny` (what `make test`
runs on CPU), the shared models' by name, or any HF config.json path.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from draftsmith.errors import DraftsmithError
from draftsmith.models.config import TargetConfig
from draftsmith.models.dtypes import DTYPES
from draftsmith.models.llama import CausalLM
from draftsmith.serve.apps.llm import LLM
from draftsmith.serve.bench import matrix
from draftsmith.serve.bench.matrix import drive, parse_concurrency
from draftsmith.serve.engine.sampling_params import SamplingParams
from draftsmith.serve.engine.step_graphs import STEP_MODES, make_step_runner, resolve_step_mode
from draftsmith.serve.speculation.cost_profile import time_forward

SHAPES = {
    "llama-3.1-8b": {"model_type": "llama", "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
                     "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                     "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
                     "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                     "tie_word_embeddings": False, "bos_token_id": 128000, "eos_token_id": 128001},
    "qwen3-8b": {"model_type": "qwen3", "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 12288,
                 "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                 "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
                 "tie_word_embeddings": False, "eos_token_id": 151645},
    "tiny": {"model_type": "llama", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "max_position_embeddings": 1024, "rms_norm_eps": 1e-5, "tie_word_embeddings": True, "eos_token_id": 0},
}
SPEC_K = 4
RATES = (0.6, 0.8)
VERIFY_KS = range(1, 9)
DRAFT_VOCAB = 32000  # EAGLE-3's usual draft vocabulary (of the target's, when that is larger)


def shape_config(shape: str, shared: str) -> dict:
    """The HF config of `shape`: a named one, a shared model's, or a config.json (or its folder)."""
    if shape in SHAPES:
        return dict(SHAPES[shape])
    for path in (Path(shared) / "models" / shape / "config.json", Path(shape) / "config.json", Path(shape)):
        if path.is_file():
            return json.loads(path.read_text())
    raise DraftsmithError(f"--shape {shape!r}: not one of {', '.join(SHAPES)}, a model under {shared}/models, or a "
                          "config.json")


def random_target(hf_config: dict, device: torch.device, dtype: torch.dtype, max_len: int, seed: int = 0) -> CausalLM:
    """The model built from its config with random weights in `dtype` on `device` (made there directly: an 8B
    model never passes through fp32 or the host)."""
    config = TargetConfig.from_hf_dict(hf_config)
    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = CausalLM(config)
    finally:
        torch.set_default_dtype(default)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.eval().requires_grad_(False)
    model.init_rope(max_len)
    return model


def _random_eagle3_head(target: CausalLM, model_dir: Path, directory: Path) -> Path:
    from draftsmith.methods import resolve_method
    from draftsmith.models.heads import DraftHeadConfig

    method = resolve_method("eagle3")
    layers = method.default_feature_layers(target.config.num_hidden_layers)
    config = DraftHeadConfig.for_target("eagle3", target.config, layers, min(DRAFT_VOCAB, target.config.vocab_size),
                                        str(model_dir))
    method.head_module(config).attach_target(target).save_pretrained(directory)
    return directory


def dispatch(args: argparse.Namespace) -> int:
    """`draftsmith bench`: the shape bench with --shape, else the shared models' matrix (`matrix.run`)."""
    if args.shape is not None and getattr(args, "peer", None):
        raise DraftsmithError("--peer compares the shared models' matrix; it does not run with --shape")
    return run(args) if args.shape is not None else matrix.run(args)


def run(args: argparse.Namespace) -> int:
    if not args.random_weights:
        raise DraftsmithError("--shape builds the model from its config alone: pass --random-weights (no weights "
                              "are downloaded)")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = DTYPES[args.dtype] if args.dtype != "auto" else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    hf_config = shape_config(args.shape, args.shared)
    batches = parse_concurrency(args.concurrency or "1,8,32")
    prompt_len, max_tokens = args.prompt_len, args.max_tokens
    max_len = prompt_len + max_tokens + SPEC_K + 2
    modes = _step_modes(args.step_modes, device)
    target = random_target(hf_config, device, dtype, max_len)
    params_b = sum(p.numel() for p in target.parameters()) / 1e9
    print(f"shape {args.shape}: {params_b:.2f}B parameters, random weights, {str(dtype).removeprefix('torch.')} on "
          f"{device}; prompts of {prompt_len} random tokens, {max_tokens} new tokens each, greedy", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "target"
        model_dir.mkdir()
        (model_dir / "config.json").write_text(json.dumps(hf_config))
        head_dir = _random_eagle3_head(target, model_dir, Path(tmp) / "eagle3")
        llms = {}
        for mode in modes:
            common = {"model": model_dir, "dtype": args.dtype, "device": str(device), "max_num_seqs": max(batches),
                      "max_model_len": max_len, "target": target, "skip_tokenizer_init": True, "step_mode": mode}
            label = "" if len(modes) == 1 else f" [{mode}]"
            llms[f"none{label}"] = LLM(**common)
            for rate in RATES:
                llms[f"eagle3 k={SPEC_K} accept {rate}{label}"] = LLM(**common, speculative_config={
                    "method": "eagle3", "model": str(head_dir), "num_speculative_tokens": SPEC_K, "adaptive": False,
                    "rejection_sample_method": "synthetic", "synthetic_acceptance_rate": rate})
        generator = torch.Generator().manual_seed(0)
        vocab = target.config.vocab_size
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        for llm in llms.values():  # warm-up: kernels, caches
            llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
        results = []
        for batch in batches:
            prompts = [torch.randint(1, vocab, (prompt_len,), generator=generator).tolist()
                       for _ in range(max(batch * args.waves, args.num_prompts))]
            for llm in llms.values():
                llm.engine.reset_metrics()
            runs = drive(llms, prompts, params, batch)
            base = next(iter(runs.values())).tokens_per_s  # no speculation, the first mode
            for method, run in runs.items():
                metrics = llms[method].get_metrics()
                drafts = metrics.get("num_drafts", 0)
                accepted = 1 + metrics.get("num_accepted_tokens", 0) / drafts if drafts else None
                ms = 1000 * batch / run.tokens_per_s  # per token of one request: the latency a user sees
                results.append({"batch": batch, "method": method, "ms_per_token": ms, "tokens_per_s": run.tokens_per_s,
                                "speedup": run.tokens_per_s / base, "acceptance_length": accepted})
                print(f"  batch {batch:3d}  {method:36s} {ms:8.2f} ms/token  {run.tokens_per_s:9.1f} tok/s  "
                      f"{run.tokens_per_s / base:5.2f}x" + (f"  acceptance {accepted:.2f}" if accepted else ""),
                      flush=True)
    curves = {}
    for mode in modes:
        one, verify = _verify_curve(target, mode, prompt_len)
        curves[mode] = {"decode_ms": one * 1000, "verify_ratio": {k: v / one for k, v in verify.items()}}
        print(f"  verify cost at batch 1, {mode} (a forward of k + 1 tokens / one of 1 token, {one * 1000:.2f} ms): " +
              "  ".join(f"k={k} {verify[k] / one:.2f}x" for k in VERIFY_KS), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"shape": args.shape, "device": str(device), "rows": results,
                                               **curves[modes[0]], "step_modes": curves}, indent=2))
    return 0


def _step_modes(text: str | None, device: torch.device) -> list[str]:
    modes = (text or ("eager,cuda-graph" if device.type == "cuda" else "eager")).split(",")
    for mode in modes:
        if mode not in STEP_MODES or mode == "auto":
            raise DraftsmithError(f"--step-modes: {mode!r} is not one of eager, cuda-graph, compile")
        resolve_step_mode(mode, False, device)  # cuda-graph on a CPU: a one-line error now, not after the setup
    return modes


def _verify_curve(target: CausalLM, mode: str, context: int) -> tuple[float, dict[int, float]]:
    """Median seconds of a one-token forward at batch 1, and of k + 1 tokens for each k, as `mode` runs them."""
    cache = target.make_cache(1, context + max(VERIFY_KS) + 1)
    runner = make_step_runner(target, cache, 1, (), mode)
    if runner is None:
        return (time_forward(target, cache, 1, 1, context, 10),
                {k: time_forward(target, cache, 1, k + 1, context, 10) for k in VERIFY_KS})

    def timed(width: int, repeats: int = 10) -> float:
        ids = torch.zeros(1, width, dtype=torch.long, device=target.model.embed_tokens.weight.device)
        times = []
        for attempt in range(repeats + 2):  # the first two capture or compile
            start = time.perf_counter()
            runner.forward(ids, [0], [context], [width])
            if target.model.embed_tokens.weight.device.type == "cuda":
                torch.cuda.synchronize()
            if attempt > 1:
                times.append(time.perf_counter() - start)
        return statistics.median(times)

    return timed(1), {k: timed(k + 1) for k in VERIFY_KS}
