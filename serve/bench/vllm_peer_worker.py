"""vLLM's side of `draftsmith bench --peer vllm`: one model and one speculative config, loaded once, then a
round of a level per command, timed the way draftsmith's bench times its own engine (`matrix._Run`).

It runs with the peer venv's python, by file path: that venv has vLLM's CPU build and no draftsmith, so this
file imports only vLLM (inside `main`) and the standard library. Usage:

    VLLM_TARGET_DEVICE=cpu build/peer-vllm/bin/python vllm_peer_worker.py JOB.json

The job (written by `serve/bench/peer.py`): model, max_model_len, max_num_seqs, max_tokens, speculative_config
(vLLM's dict, or null), enforce_eager (false: vLLM compiles, its default) and levels, a list of {concurrency, prompts: [[token ids]]}. The worker speaks in
lines on stdout that begin with PREFIX (anything else there is vLLM's own output): first {"ready":
{"vllm_version", "torch_threads", "startup_s"}}, or {"refused": reason} where vLLM would not load the model
with that config. Then, for each line {"concurrency": c} on stdin, one round of that level: {"round":
{"concurrency", "tokens_per_s", "whole_run_tokens_per_s", "outputs" (token ids, in prompt order),
"mean_acceptance_length", "acceptance_per_position"}}, or {"failed": reason}. Reasons are one line. The bench sends a level's round
right after draftsmith's round of it, so that both engines are timed seconds apart, not minutes.

Concurrency c = c requests in flight, the next prompt added as one finishes, through vLLM's own step loop
(`LLMEngine.add_request` / `step`) with the engine core in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0,
set by the caller), so that a step's time is the step's work, as in draftsmith's loop; under the bench's
`--peer-binding own` the caller leaves vLLM's defaults, and `step` collects what the engine core's own
process decoded meanwhile (its torch_threads are then this process's, not the core's). Tokens/s counts the
steps that begin with c requests in flight once the first c have their first tokens; the whole run's, drain
included, is reported beside it. Unlike draftsmith's window, this one keeps the prefills inside it: vLLM
runs prefill chunks inside its decode forwards, so their seconds cannot be taken apart, and a speculating
row, whose requests finish unevenly, may read high, as draftsmith's house n-gram row did by 7-10% at 8 in
flight before its window was corrected (docs/benchmarks.md).
Requests are not detokenized (draftsmith's engine does not detokenize without stop strings either).
"""

from __future__ import annotations

import itertools
import json
import sys
import time
import traceback

SPEC_COUNTERS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_accepted_tokens")
PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"  # a vector: accepted drafts at each position
WARMUP_TOKENS = 8
PREFIX = "DRAFTSMITH-PEER "  # starts the worker's protocol lines on stdout


class StepRun:
    """One pass over `prompts` with `concurrency` requests in flight, advanced a step at a time: the peer's
    `matrix._Run`. `engine` is vLLM's LLMEngine (add_request, step, has_unfinished_requests)."""

    def __init__(self, engine, prompts: list[list[int]], params, concurrency: int, tag: str):
        self.engine, self.params, self.tag = engine, params, tag
        self.outputs: list[list[int] | None] = [None] * len(prompts)
        self.live: dict[str, int] = {}  # request id -> tokens generated so far
        self.queue = iter(enumerate(prompts))
        self.concurrency = concurrency
        self.seconds = 0.0
        self.steady_seconds, self.steady_tokens = 0.0, 0
        self.last_id = f"{tag}-{len(prompts) - 1}"  # its first token closes the steady window: `matrix._Run`
        self.ended = False
        start = time.perf_counter()
        for _ in range(concurrency):
            self._add_next()
        self.seconds += time.perf_counter() - start
        self.starting = set(self.live)  # the first c requests until each has a token: `matrix._Run`'s rule

    def _add_next(self) -> None:
        for index, ids in itertools.islice(self.queue, 1):
            request_id = f"{self.tag}-{index}"
            self.engine.add_request(request_id, {"prompt_token_ids": ids}, self.params)
            self.live[request_id] = 0

    @property
    def done(self) -> bool:
        return not self.engine.has_unfinished_requests()

    def step(self) -> None:
        steady = len(self.live) == self.concurrency and not self.starting and not self.ended
        start = time.perf_counter()
        new_tokens = 0
        for output in self.engine.step():
            ids = list(output.outputs[0].token_ids)  # cumulative: every token so far
            new_tokens += len(ids) - self.live[output.request_id]
            self.live[output.request_id] = len(ids)
            if ids:
                self.starting.discard(output.request_id)
                self.ended = self.ended or output.request_id == self.last_id
            if output.finished:
                del self.live[output.request_id]
                self.outputs[int(output.request_id.rsplit("-", 1)[1])] = ids
                self._add_next()
        seconds = time.perf_counter() - start
        self.seconds += seconds
        if steady:
            self.steady_seconds += seconds
            self.steady_tokens += new_tokens

    def run(self) -> StepRun:
        while not self.done:
            self.step()
        return self

    @property
    def tokens_per_s(self) -> float:
        if self.steady_seconds > 0 and self.steady_tokens > 0:
            return self.steady_tokens / self.steady_seconds
        return self.whole_run_tokens_per_s

    @property
    def whole_run_tokens_per_s(self) -> float:
        return sum(map(len, self.outputs)) / self.seconds


def spec_counts(metrics) -> dict[str, float | list[float]]:
    """The spec-decode counters (drafts, accepted tokens, accepted per position) summed over their labels;
    absent ones are 0 (no positions)."""
    counts: dict = {**dict.fromkeys(SPEC_COUNTERS, 0.0), PER_POSITION: []}
    for metric in metrics:
        if metric.name in SPEC_COUNTERS:
            counts[metric.name] += metric.value
        elif metric.name == PER_POSITION:
            per_position = counts[PER_POSITION]
            for position, value in enumerate(metric.values):
                if position == len(per_position):
                    per_position.append(0.0)
                per_position[position] += value
    return counts


def acceptance(before: dict, after: dict) -> dict:
    """Between two counter snapshots: the mean acceptance length, 1 + accepted / drafts, and the rate each draft
    position was accepted at (None and [] without drafts)."""
    drafts = after[SPEC_COUNTERS[0]] - before[SPEC_COUNTERS[0]]
    if not drafts:
        return {"mean_acceptance_length": None, "acceptance_per_position": []}
    accepted = after[SPEC_COUNTERS[1]] - before[SPEC_COUNTERS[1]]
    was = before[PER_POSITION] + [0.0] * (len(after[PER_POSITION]) - len(before[PER_POSITION]))
    return {"mean_acceptance_length": 1 + accepted / drafts,
            "acceptance_per_position": [(a - b) / drafts for a, b in zip(after[PER_POSITION], was)]}


def one_line(exc: BaseException) -> str:
    """The gist of a vLLM error, with its type: a pydantic error's first message (vLLM validates its configs
    with pydantic, whose text ends in a link), else the last message line; its first sentence either way."""
    errors = getattr(exc, "errors", None)
    if callable(errors):
        try:
            message = errors()[0]["msg"].removeprefix("Value error, ")
        except (TypeError, LookupError, AttributeError):
            message = str(exc)
    else:
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        message = lines[-1] if lines else "no message"
    message = message.strip().splitlines()[0] if message.strip() else "no message"
    first, dot, rest = message.partition(". ")
    return f"{type(exc).__name__}: {first}{dot.strip() if rest else ''}"[:300]


def say(message: dict) -> None:
    """One protocol line on stdout, on a line of its own (vLLM's progress bars may leave one unfinished)."""
    print("\n" + PREFIX + json.dumps(message), flush=True)


def answer_commands(argv: list[str], load, answer, key: str) -> int:
    """A worker's whole life (datagen's and capture's): the job file argv[0] loaded by `load` -> {"ready"} or
    {"refused": reason}; then, per command line on stdin, {key: answer(llm, command)} or {"failed": reason}."""
    job = json.loads(open(argv[0]).read())
    start = time.perf_counter()
    try:
        llm = load(job)
    except Exception as exc:  # vLLM refuses models and settings with a wide range of exception types
        traceback.print_exc()
        say({"refused": one_line(exc)})
        return 0
    import vllm

    say({"ready": {"vllm_version": vllm.__version__, "startup_s": time.perf_counter() - start}})
    for line in sys.stdin:
        try:
            say({key: answer(llm, json.loads(line))})
        except Exception as exc:
            traceback.print_exc()
            say({"failed": one_line(exc)})
    return 0


def load(job: dict):
    from vllm import LLM

    spec = job.get("speculative_config")
    # stats only where they are read: the spec-decode counters need them
    return LLM(job["model"], dtype="float32", enforce_eager=job.get("enforce_eager", True), max_model_len=job["max_model_len"],
               enable_prefix_caching=False, max_num_seqs=job["max_num_seqs"], speculative_config=spec,
               disable_log_stats=spec is None, seed=0)


def serve(llm, job: dict, commands) -> None:
    """A round of a level per command line ({"concurrency": c}), each answered by its result line."""
    from vllm import SamplingParams

    engine, speculating = llm.llm_engine, job.get("speculative_config") is not None
    params = SamplingParams(temperature=0, max_tokens=job["max_tokens"], detokenize=False)
    prompts = {level["concurrency"]: level["prompts"] for level in job["levels"]}
    for index, line in enumerate(commands):
        c = json.loads(line)["concurrency"]
        before = spec_counts(llm.get_metrics()) if speculating else None
        run = StepRun(engine, prompts[c], params, c, f"c{c}r{index}").run()
        accept = acceptance(before, spec_counts(llm.get_metrics())) if speculating else {}
        say({"round": {"concurrency": c, "tokens_per_s": run.tokens_per_s,
                       "whole_run_tokens_per_s": run.whole_run_tokens_per_s, "outputs": run.outputs,
                       "mean_acceptance_length": accept.get("mean_acceptance_length"),
                       "acceptance_per_position": accept.get("acceptance_per_position", [])}})


def main(argv: list[str]) -> int:
    job = json.loads(open(argv[0]).read())
    start = time.perf_counter()
    try:
        llm = load(job)
    except Exception as exc:  # vLLM refuses configs with a wide range of exception types
        traceback.print_exc()
        say({"refused": one_line(exc)})
        return 0
    import torch
    import vllm
    from vllm import SamplingParams

    warm = SamplingParams(temperature=0, max_tokens=WARMUP_TOKENS, detokenize=False)
    StepRun(llm.llm_engine, job["levels"][0]["prompts"][:1], warm, 1, "warmup").run()
    say({"ready": {"vllm_version": vllm.__version__, "torch_threads": torch.get_num_threads(),
                   "startup_s": time.perf_counter() - start}})
    try:
        serve(llm, job, sys.stdin)
    except Exception as exc:
        traceback.print_exc()
        say({"failed": one_line(exc)})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
