"""`draftsmith bench`: a side-by-side throughput matrix of speculation methods against no speculation.

For each model, every method (the --speculative-config one, n-gram by default, and every head shipped as
assets/MODEL-HEADTYPE) and no speculation run at each concurrency level on the same validation code
prompts, greedy. Concurrency c means c requests in flight: the bench drives the engine itself and queues the
next prompt as soon as one finishes, the way a server under steady load sees it, over several waves of c
prompts (`--waves`). Tokens/s is measured over the steps that start with c requests in flight (`_Run`):
the final drain, once no prompt is left to take a finished one's place, runs at a lower concurrency and is
timed apart (`whole_run_tokens_per_s`). Ratios are
taken within the run, never against numbers from another machine or day: the methods' engines take turns of
SLICE_S seconds of steps, each timed over its own, and share one copy of the target's weights. Each method's tokens are checked
against no speculation's at the same level. HF transformers `generate`, one prompt at a time, is timed at
concurrency 1 as the baseline users know.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from pathlib import Path

import torch

from draftsmith.corpus import code_prompts, edit_prompts, held_out_code_prompts
from draftsmith.cpu_load import wait_for_quiet
from draftsmith.errors import DraftsmithError
from draftsmith.methods import method_names, read_head_config, resolve_method, servable
from draftsmith.models.tokenizer import load_tokenizer
from draftsmith.serve.apps.llm import LLM
from draftsmith.serve.bench.peer import Peer
from draftsmith.serve.bench.plot import plot_speedups, require_matplotlib
from draftsmith.serve.bench.turns import TurnOrders
from draftsmith.serve.engine.outputs import OutputCollector
from draftsmith.serve.engine.sampling_params import SamplingParams
from draftsmith.serve.engine.structured_outputs import StructuredOutputsParams

ASSETS = Path(__file__).resolve().parents[2] / "assets"
NO_SPEC = "none"  # the row every ratio divides by
# --control: a second engine without speculation, timed in turns like every method: its ratio to NO_SPEC
# (1.00x on a quiet machine) is what the run's noise alone moves a row by
CONTROL = "none-control"
HF = "hf"  # HF transformers generate, concurrency 1 only
DRAFT_OVERSHOOT = 16  # cache room past prompt + max_tokens for the drafts a last verify step writes


def parse_concurrency(text: str) -> list[int]:
    """'1,4,8' -> [1, 4, 8] (sorted, deduplicated); DraftsmithError naming the bad value otherwise."""
    levels = set()
    for part in text.split(","):
        try:
            level = int(part)
        except ValueError:
            raise DraftsmithError(f"--concurrency: {part.strip()!r} is not an integer "
                                  "(expected comma-separated positive integers, e.g. 1,4,8)") from None
        if level < 1:
            raise DraftsmithError(f"--concurrency: levels must be >= 1, got {level}")
        levels.add(level)
    return sorted(levels)


def level_prompts(args, concurrency: int) -> int:
    return max(args.waves * concurrency, args.num_prompts)


def shipped_heads(model_name: str) -> dict[str, Path]:
    """Heads shipped for a model, by method: `assets/MODEL-HEADTYPE` for every servable head-based method."""
    found = {}
    for name in method_names(lambda m: servable(m) and m.needs.head):
        head = ASSETS / f"{model_name}-{resolve_method(name).head_type}"
        if head.is_dir():
            found[name] = head
    return found


def row_name(config: dict) -> str:
    """A bench row's method name: the config's method, but `pard` for a draft model drafting in parallel,
    `peagle` for an EAGLE-3 head doing so, and `METHOD-tree` for a config drafting trees, so that two ways of
    drafting with one head or model can be compared in one run."""
    method = config.get("method", "?")
    if config.get("parallel_drafting"):
        return {"draft_model": "pard", "eagle3": "peagle"}.get(method, f"{method}-parallel")
    return f"{method}-tree" if config.get("tree_depth") or config.get("speculative_token_tree") else method


def _fixed(config: dict) -> bool:
    return config.get("adaptive") is False


def configured_methods(spec_config: str | None) -> dict[str, dict]:
    """--speculative-config's rows by name (`row_name`). Configs that share a name are told apart: the one
    drafting a fixed k (`"adaptive": false`) beside the planner's is `NAME-fixed`, a second head or model
    `NAME@folder`, the same drafter at another k `NAME@kN`."""
    methods: dict[str, dict] = {}
    if spec_config:
        try:
            configs = json.loads(spec_config)
        except json.JSONDecodeError as exc:
            raise DraftsmithError(f"--speculative-config is not valid JSON ({exc.msg})") from None
        for config in configs if isinstance(configs, list) else [configs]:
            if not isinstance(config, dict):
                raise DraftsmithError("--speculative-config must be a JSON object, or a list of them")
            name = row_name(config)
            if name in methods and _fixed(config) != _fixed(methods[name]):
                if _fixed(methods[name]):  # the planner's config keeps the method's name
                    methods = {f"{name}-fixed" if n == name else n: c for n, c in methods.items()}
                else:
                    name = f"{name}-fixed"
            if name in methods and config.get("model") not in (None, methods[name].get("model")):
                name = f"{name}@{Path(str(config['model'])).name}"
            elif name in methods and config.get("num_speculative_tokens") != methods[name].get("num_speculative_tokens"):
                name = f"{name}@k{config.get('num_speculative_tokens')}"
            if name in methods:
                raise DraftsmithError(f"--speculative-config names {name!r} twice: one config a method, or a "
                                      "method's heads in folders of different names, or at different k")
            methods[name] = config
    return methods


def speculation_methods(model_name: str, spec_config: str | None, k: int) -> dict[str, dict]:
    """--speculative-config's rows, then the heads shipped for the model whose method those leave out."""
    methods = configured_methods(spec_config)
    for name, head in shipped_heads(model_name).items():
        if name not in methods:  # the user's own config for a method wins over the shipped head
            # heads drafting one token per head or stage (Medusa, MLP speculator) draft no more than they have;
            # heads drafting a whole block in one forward (DFlash) draft all of it
            most = read_head_config(json.loads((head / "config.json").read_text()), head).max_drafts()
            wanted = most if resolve_method(name).needs.parallel and most else min(k, most or k)
            methods[name] = {"method": name, "model": str(head), "num_speculative_tokens": wanted}
    return methods


class _Run:
    """One method's pass over the prompts, `concurrency` requests in flight, advanced a step at a time."""

    def __init__(self, llm: LLM, prompts: list[list[int]], params: SamplingParams, concurrency: int):
        self.engine, self.params = llm.engine, params
        self.outputs: list[list[int] | None] = [None] * len(prompts)
        self.live: dict[str, int] = {}
        self.collector = OutputCollector()
        self.queue = iter(enumerate(prompts))
        self.concurrency = concurrency
        self.seconds = 0.0  # this run's own steps, admissions included
        self.prefill_seconds = 0.0  # the prefill phases of all of them (`LLMEngine.stats["prefill_s"]`)
        # The steps that began with `concurrency` requests in flight, the tokens they generated and their
        # prefill phases' seconds: the level's measurement (`tokens_per_s`). Once the queue is empty,
        # finished requests leave fewer behind, and how long that drain lasts depends on how unevenly requests
        # finish (speculation makes them finish unevenly, plain decoding of equal max_tokens not at all): 19%
        # of a 3-wave level's tokens at 8 in flight (house n-gram), at a concurrency the level is not about.
        self.steady_seconds, self.steady_tokens, self.steady_prefill_seconds = 0.0, 0, 0.0
        self.last_id: str | None = None  # the last prompt's request, once admitted
        self.ended = False  # the last prompt has its first token: the steady window is closed
        self.total = len(prompts)
        start = time.perf_counter()
        for _ in range(concurrency):
            self._add_next()
        self.seconds += time.perf_counter() - start
        # The window opens once the first c requests have their first tokens and closes once the last prompt
        # has its first token (the drain follows). Its tokens are charged their share of prefill
        # (`tokens_per_s`), not the prefills that happened to fall inside it: requests finishing unevenly
        # decode more of the next ones' tokens before the window closes, so a window that kept its own
        # prefills held 16 prefills to about 19 requests' tokens for house n-gram at 8 in flight (24
        # prompts), against 16 to 16 for plain decoding, and ran 1.10-1.13x plain decoding's tokens/s where
        # its decode phases took the same seconds for the same tokens.
        self.starting = set(self.live)

    def _add_next(self) -> None:
        for index, ids in itertools.islice(self.queue, 1):
            request_id = self.engine.add_request(ids, self.params).request_id
            self.live[request_id] = index
            if index == self.total - 1:
                self.last_id = request_id

    @property
    def done(self) -> bool:
        return not self.engine.has_unfinished_requests()

    def step(self) -> None:
        steady = len(self.live) == self.concurrency and not self.starting and not self.ended
        generated, prefilled = self.engine.stats["num_generated_tokens"], self.engine.stats["prefill_s"]
        start = time.perf_counter()
        for output in self.collector.add_all(self.engine.step()):
            if output.outputs[0].token_ids:
                self.starting.discard(output.request_id)
                self.ended = self.ended or output.request_id == self.last_id
            if output.finished:
                self.outputs[self.live.pop(output.request_id)] = output.outputs[0].token_ids
                self._add_next()
        seconds = time.perf_counter() - start
        prefill = self.engine.stats["prefill_s"] - prefilled
        self.seconds += seconds
        self.prefill_seconds += prefill
        if steady:
            self.steady_seconds += seconds
            self.steady_prefill_seconds += prefill
            self.steady_tokens += self.engine.stats["num_generated_tokens"] - generated

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens/s while `concurrency` requests were in flight (the whole run's if never), as a steady
        stream of requests runs: the window's steps without their prefill phases, plus the prefill its tokens
        owe at the whole run's prefill seconds per generated token (`steady_rate`)."""
        if self.steady_seconds > 0 and self.steady_tokens > 0:
            return steady_rate(self.steady_tokens, self.steady_seconds - self.steady_prefill_seconds,
                               self.prefill_seconds / max(self.generated, 1))
        return self.whole_run_tokens_per_s

    @property
    def whole_run_tokens_per_s(self) -> float:
        return self.generated / self.seconds

    @property
    def generated(self) -> int:
        """Tokens generated by the requests finished so far."""
        return sum(len(ids) for ids in self.outputs if ids is not None)


def steady_rate(tokens: int, decode_seconds: float, prefill_per_token: float) -> float:
    """Tokens/s of a stream in which every request is prefilled once: `tokens` generated in `decode_seconds` of
    steps (prefill phases left out), each owing `prefill_per_token` seconds of its request's prefill."""
    return tokens / (decode_seconds + tokens * prefill_per_token)


SLICE_S = 0.25  # how long one method steps before the next takes over


def drive(llms: dict[str, LLM], prompts: list[list[int]], params: SamplingParams, concurrency: int):
    """Runs every prompt through every LLM, `concurrency` requests in flight each; -> {method: finished
    `_Run`}. The LLMs take turns of SLICE_S seconds of steps and each is timed over its own
    steps only, so a change in machine speed (this VM's drifts by up to 30% over minutes) reaches every
    method alike. Turns are that long, not one step, because a method stepping alone keeps its own weights
    and caches warm, as it would serving alone: switching every step cost n-gram a few percent at 8 in flight.
    Each round of turns goes in an order that evens out which method each one follows (`TurnOrders`): a
    turn's first steps run on the caches the turn before left."""
    runs = {method: _Run(llm, prompts, params, concurrency) for method, llm in llms.items()}
    orders = TurnOrders()
    while live := [run for run in runs.values() if not run.done]:
        for run in orders.next_round(live):
            turn_ends = run.seconds + SLICE_S
            while not run.done and run.seconds < turn_ends:
                run.step()
    return runs


def _time_hf(model_dir: Path, tokenizer, prompts: list[str], max_tokens: int) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    tokens, start = 0, time.perf_counter()
    with torch.inference_mode():
        for prompt in prompts:
            ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False).input_ids
            out = model.generate(ids, max_new_tokens=max_tokens, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id)
            tokens += out.shape[1] - ids.shape[1]
    return tokens / (time.perf_counter() - start)


def paired_ratio(speeds: list[float], reference: list[float]) -> float:
    """The median over rounds of speeds[r] / reference[r]: the methods of a round take turns of SLICE_S seconds
    (`drive`), so a round's ratio is free of the machine's drift between rounds, which a ratio of the two
    medians keeps (medians from different rounds). Speeds not timed round for round beside the reference
    (one HF round): the ratio of the medians."""
    if len(speeds) != len(reference):
        return statistics.median(speeds) / statistics.median(reference)
    return statistics.median(s / r for s, r in zip(speeds, reference))


def _row(model: str, method: str, k: int | None, c: int, speeds: list[float], metrics: dict,
         equal: bool | None, level: list[dict], whole_run: list[float] | None = None,
         grammar_share: float | None = None, prefill_share: float | None = None) -> dict:
    """One JSON row; `level` holds the rows already made at this concurrency, no speculation's first;
    `speeds` per round at c in flight, `whole_run` per round over the whole run, drain included;
    `grammar_share`: of the last round's engine time, the structured-output matchers' (None: no grammar);
    `prefill_share`: of the last round's engine time, its prefill phases' (None: not timed).
    A speedup is the median over rounds of the round's ratio to no speculation's (`paired_ratio`)."""
    whole_run = whole_run or speeds
    speed, whole = statistics.median(speeds), statistics.median(whole_run)
    return {"model": model, "method": method, "k": k, "concurrency": c, "tokens_per_s": speed,
            "speedup_vs_no_spec": paired_ratio(speeds, level[0]["tokens_per_s_by_round"]) if level else 1.0,
            "whole_run_tokens_per_s": whole,
            "whole_run_speedup_vs_no_spec": paired_ratio(whole_run, level[0]["whole_run_tokens_per_s_by_round"])
            if level else 1.0,
            "tokens_per_s_by_round": speeds, "whole_run_tokens_per_s_by_round": whole_run,
            "mean_acceptance_length": metrics.get("mean_acceptance_length"), "greedy_equal": equal,
            "spec_k_histogram": metrics.get("spec_k_histogram"),
            "num_steps_without_speculation": metrics.get("num_steps_without_speculation"),
            "step_profile": metrics.get("step_profile"), "grammar_share": grammar_share,
            "prefill_share": prefill_share}


def bench_texts(args, count: int) -> tuple[list[str], str]:
    """`count` prompts for the bench and what they are: by default code from the validation repositories that
    the training split lacks (cycled where they give fewer), the code heads are measured on."""
    data = Path(args.shared) / "data"
    validation, train = data / "code-validation.jsonl.xz", data / "code-train.jsonl.xz"
    needed = [validation, train] if args.prompts == "held-out" and args.workload != "edit" else [validation]
    for path in needed:
        if not path.is_file():
            raise DraftsmithError(f"benchmark data {path} not found; pass --shared DIR (the folder holding data/ and "
                                  "models/)")
    if args.workload == "edit":
        return edit_prompts(validation, count), "validation code-edit prompts"
    if args.prompts == "validation":
        return code_prompts(validation, count), "validation code prompts"
    distinct = held_out_code_prompts(validation, train, count)
    texts = list(itertools.islice(itertools.cycle(distinct), count))
    if args.workload == "json":
        texts = [text + JSON_CUE for text in texts]
    return texts, (f"code prompts from validation repositories the training split lacks ({len(distinct)} "
                   "distinct, cycled)" if len(distinct) < count else "code prompts from validation repositories "
                   "the training split lacks")


# --workload json: each code prompt is followed by this cue and answered under BENCH_SCHEMA, a record of
# required keys (stretches the grammar writes alone), enums and bounded strings and lists
JSON_CUE = "\n\n# what the code above does, as JSON:\nsummary = "
BENCH_SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 32}, "kind": {"enum": ["function", "class", "script", "test"]},
    "arguments": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 4},
    "returns": {"type": "string", "maxLength": 24}, "lines": {"type": "integer", "minimum": 0},
    "pure": {"type": "boolean"}},
    "required": ["name", "kind", "arguments", "returns", "lines", "pure"], "additionalProperties": False}


STEPWISE = "none-stepwise"  # --workload json: no speculation and no grammar drafts, one token a forward


def bench_params(args) -> SamplingParams:
    """Greedy, --max-tokens; under BENCH_SCHEMA for --workload json."""
    constraint = StructuredOutputsParams(json=BENCH_SCHEMA) if args.workload == "json" else None
    return SamplingParams(temperature=0, max_tokens=args.max_tokens, structured_outputs=constraint)


def level_batch(args, prompts: list[list[int]], concurrency: int) -> list[list[int]]:
    """The prompts a level runs, in order: the first max(waves x c, num_prompts), sent --repeat times."""
    return prompts[: level_prompts(args, concurrency)] * args.repeat


def bench_model(args, name: str, levels: list[int], texts: list[str], peer=None) -> list[dict]:
    """The matrix for one model: a row per (method, concurrency), each printed once measured; with `peer`
    (`bench.peer.Peer`), the same methods and levels through the peer engine, merged into the rows."""
    model_dir = Path(args.shared) / "models" / name
    if not model_dir.is_dir():
        raise DraftsmithError(f"model {model_dir} not found (--models names folders under SHARED/models)")
    tokenizer = load_tokenizer(model_dir)
    prompts = [tokenizer(t, add_special_tokens=False).input_ids for t in texts]
    found = speculation_methods(name, args.speculative_config, args.head_k)
    wanted = [m.strip() for m in args.methods.split(",")] if args.methods else list(found)
    missing = [m for m in wanted if m not in found and m != NO_SPEC]
    if missing:
        raise DraftsmithError(f"--methods {', '.join(missing)}: not run for {name} (found: {', '.join(found) or 'none'}; "
                              "a method without a shipped head needs --speculative-config)")
    left_out = [m for m in configured_methods(args.speculative_config) if m not in wanted]
    if left_out:
        raise DraftsmithError(f"--speculative-config gives {', '.join(left_out)}, which --methods "
                              f"({args.methods}) leaves out: name them in --methods, or leave --methods out")
    configs = {NO_SPEC: None, **({CONTROL: None} if args.control else {}),
               **({STEPWISE: None} if args.workload == "json" else {}),
               **{m: c for m, c in found.items() if m in wanted}}
    # one engine per method, reused at every level: loading and cost profiling stay out of the timings; all
    # on one copy of the target's weights, so that where each copy sits in memory (worth a few percent of
    # forward speed between otherwise identical engines) favours no method
    llms: dict[str, LLM] = {}
    for method, config in configs.items():
        llms[method] = LLM(model_dir, dtype="float32", device="cpu", max_num_seqs=max(levels),
                           max_model_len=max(map(len, prompts)) + args.max_tokens + DRAFT_OVERSHOOT,
                           speculative_config=config, target=next(iter(llms.values())).model if llms else None,
                           step_mode=args.step_mode)
    if STEPWISE in llms:
        llms[STEPWISE].engine.max_forced = 0  # what plain structured decoding is without grammar drafts
    for llm in llms.values():
        llm.generate({"prompt_token_ids": prompts[0]}, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    # the peer's engines load now, before anything is timed; each draftsmith round is followed by the peer's
    session = None if peer is None else peer.session(
        args, model_dir, {m: c for m, c in configs.items() if m != CONTROL},
        {c: level_batch(args, prompts, c) for c in levels})
    try:
        rows, references = _levels(args, name, levels, (texts, prompts, tokenizer), llms, session)
    finally:
        if session is not None:
            session.close()
    return rows if session is None else peer.merge(model_dir, session, references, rows)


def _levels(args, name: str, levels: list[int], workload: tuple, llms: dict[str, LLM],
            session) -> tuple[list[dict], dict[int, list[list[int]]]]:
    """Every level's rows, and no speculation's token ids by level (what the peer's must equal); `workload`:
    the prompts' texts, their token ids and the tokenizer. With `session` (`peer.PeerSession`), each round
    of a level also runs through the peer, right after ours."""
    model_dir = Path(args.shared) / "models" / name
    texts, prompts, tokenizer = workload
    params = bench_params(args)
    rows, references = [], {}
    for c in levels:
        batch = level_batch(args, prompts, c)
        runs = {m: [] for m in llms}  # per method: a finished _Run per round
        for _ in range(args.rounds):
            if args.quiet_wait:
                wait_for_quiet(max_wait_s=args.quiet_wait)
            for llm in llms.values():
                llm.engine.reset_metrics()  # drops the warm-up's and the previous run's counts
                if llm.engine.proposer is not None:
                    llm.engine.proposer.forget()  # every round starts without earlier rounds' outputs
            for method, run in drive(llms, batch, params, c).items():
                runs[method].append(run)
            if session is not None:
                session.run_round(c)
        references[c] = runs[NO_SPEC][0].outputs
        level: list[dict] = []  # no speculation's row first: every ratio at this level divides by it
        for method, llm in llms.items():
            spec = llm.engine.spec_config
            equal = all(run.outputs == runs[NO_SPEC][0].outputs for run in runs[method])  # every round, too
            # metrics are the last round's: greedy acceptance is the same in every round
            metrics, last = llm.get_metrics(), runs[method][-1]
            share = metrics["grammar_mask_s"] / last.seconds if metrics.get("grammar_masks") else None
            level.append(_row(name, method, spec and spec.num_speculative_tokens, c,
                              [run.tokens_per_s for run in runs[method]], metrics, equal, level,
                              [run.whole_run_tokens_per_s for run in runs[method]], share,
                              last.prefill_seconds / last.seconds))
            _print_row(level[-1], args.profile)
        if c == 1 and not args.no_hf:
            hf = _time_hf(model_dir, tokenizer, texts[: max(1, args.num_prompts)], args.max_tokens)
            level.append(_row(name, HF, None, 1, [hf], {}, None, level))
            _print_row(level[-1], args.profile)
        rows += level
    return rows, references


def _label(row: dict) -> str:
    return row["method"] if row["k"] is None else f"{row['method']} k={row['k']}"


def _print_row(row: dict, profile: bool) -> None:
    line = (f"  {row['model']} c={row['concurrency']} {_label(row)}: {row['tokens_per_s']:.1f} tok/s, "
            f"{row['speedup_vs_no_spec']:.2f}x")
    if "whole_run_speedup_vs_no_spec" in row and row["method"] != HF:
        line += f" (whole run, drain included: {row['whole_run_speedup_vs_no_spec']:.2f}x)"
    if row["k"] is not None:
        line += f", acceptance {row['mean_acceptance_length']:.2f}"
        if row["spec_k_histogram"] is not None:
            line += ", k chosen " + " ".join(f"{k}:{n}" for k, n in enumerate(row["spec_k_histogram"]) if n)
        if row["num_steps_without_speculation"] is not None:
            line += f", {row['num_steps_without_speculation']} steps unspeculated"
    if row.get("grammar_share") is not None:
        line += f", grammar {row['grammar_share']:.1%} of the time"
    if row.get("prefill_share"):
        line += f", prefill {row['prefill_share']:.0%} of the run"
        if row["method"] == NO_SPEC:  # speculation speeds the decode steps only
            line += f" (speculation's ceiling {1 / row['prefill_share']:.1f}x)"
    if row["greedy_equal"] is not None:
        line += ", greedy equal" if row["greedy_equal"] else ", GREEDY MISMATCH vs no speculation"
    print(line, flush=True)
    if profile and row["step_profile"]:
        print(f"    {_profile_line(row['step_profile'])}", flush=True)


def _profile_line(profile: dict) -> str:
    """ms per decode step of each timed part (every `*_s` key, so a new part shows up unasked) and its share."""
    steps = profile.get("decode_steps", 0)
    parts = {key.removesuffix("_s"): secs for key, secs in profile.items() if key.endswith("_s")}
    total = sum(parts.values())
    if not steps or not total:
        return "no decode steps timed"
    shares = ", ".join(f"{part} {1e3 * secs / steps:.2f} ms ({secs / total:.0%})" for part, secs in parts.items())
    return f"{steps} decode steps, {1e3 * total / steps:.2f} ms each: {shares}"


def _print_table(name: str, rows: list[dict], levels: list[int]) -> None:
    cells = {(r["method"], r["concurrency"]): r for r in rows}
    labels = {r["method"]: _label(r) for r in rows}
    width = max(map(len, labels.values())) + 2
    print(f"\n{name}: tok/s with c requests in flight and speedup vs no speculation; acc = mean acceptance length")
    print(f"{'method':<{width}}" + "".join(f"{f'c={c}':>17}" for c in levels) + "   acc by c")
    for method, label in labels.items():
        line = f"{label:<{width}}"
        accept = []
        for c in levels:
            cell = cells.get((method, c))
            line += f"{cell['tokens_per_s']:>10.1f} {cell['speedup_vs_no_spec']:>5.2f}x" if cell else " " * 17
            if cell and cell["mean_acceptance_length"] is not None:
                accept.append(f"{cell['mean_acceptance_length']:.2f}")
        print(line + "   " + ("/".join(accept) or "-"), flush=True)


def run(args: argparse.Namespace) -> int:
    levels = parse_concurrency(args.concurrency or "1,4,8,16,32")
    if not args.no_plot:
        require_matplotlib()  # now, not after a run of many minutes
    if args.peer and args.workload == "json":
        raise DraftsmithError("--peer runs the code and edit workloads; --workload json is measured against "
                              "draftsmith's own plain structured decoding")
    peer = Peer(args) if args.peer else None  # its venv checked and the threads bound before anything runs
    texts, source = bench_texts(args, level_prompts(args, levels[-1]))
    print(f"concurrency {','.join(map(str, levels))}: max({args.waves} x c, {args.num_prompts}) {source} per level, "
          f"greedy, {args.max_tokens} new tokens, fp32, {torch.get_num_threads()} CPU threads, "
          f"median of {args.rounds} round(s)" + (f", the prompts sent {args.repeat} times" if args.repeat > 1 else ""),
          flush=True)
    rows = []
    for name in filter(None, map(str.strip, args.models.split(","))):
        model_rows = bench_model(args, name, levels, texts, peer)
        _print_table(name, model_rows, levels)
        if peer is not None:
            peer.print_table(name, model_rows, levels)
        rows += model_rows
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    if not args.no_plot:
        plot = Path(args.plot or (Path(args.json).with_suffix(".png") if args.json else "bench.png"))
        plot_speedups(rows, levels, plot, exclude=(NO_SPEC, HF))
        print(f"speedup plot: {plot}")
    return 0
