"""`draftsmith bench --peer vllm`: the same prompts, greedy, max_tokens and concurrency levels through vLLM's CPU
build, side by side with draftsmith in one run (issue 39).

vLLM lives in a venv of its own (`make peer-vllm`: it pins transformers apart from ours), so it runs as a
subprocess of that venv's python on `vllm_peer_worker.py`, one process per (model, method), loaded once before
anything is timed and kept for the model's whole matrix. By default both engines get the same number of
compute threads (`--peer-threads N`: draftsmith runs N torch threads, vLLM binds N OpenMP threads to cores
0..N-1); `--peer-binding` runs vLLM at other bindings too, each row taking the fastest (`peer_bindings.py`).
Heads are exported with draftsmith's own converter (`draftsmith convert --to vllm`) into a temporary folder;
a method vLLM will not load is a row saying why, not a failed run.

Each round of a level runs through every peer worker right after draftsmith's round of it (`PeerSession`):
the machine's speed drifts by up to a third over minutes, and two engines timed minutes apart had given
ratios that moved by half between runs. Outside its rounds a worker is stopped (`PeerWorker.pause`): idle
vLLM workers poll, and would take CPU from the engine being timed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from draftsmith.errors import DraftsmithError
from draftsmith.methods import resolve_method
from draftsmith.serve.bench.peer_bindings import fastest, parse_bindings
from draftsmith.vllm_process import DEFAULT_PYTHON, OWN_BINDING, PeerWorker, bind_threads

WORKER = Path(__file__).with_name("vllm_peer_worker.py")
PEERS = ("vllm",)
PEER_MAX_MODEL_LEN = 2048  # what ../shared/docs/peers-2026-11.md runs vLLM's CPU build with
# dropped from vLLM's config: vLLM drafts a fixed k (the row still names draftsmith's), in the model's dtype
DRAFTSMITH_ONLY_KEYS = ("adaptive", "draft_dtype")
NOT_IN_VLLM = ("tree_depth", "tree_top_k")  # draftsmith's dynamic trees: no vLLM counterpart to compare with


class PeerLevel(BaseModel):
    """One concurrency level of the peer's results: a figure per round (`PeerSession.run_round`)."""

    model_config = ConfigDict(extra="forbid")
    concurrency: int
    tokens_per_s: list[float]
    whole_run_tokens_per_s: list[float]
    outputs: list[list[int]]
    rounds_equal: bool
    mean_acceptance_length: float | None = None


class PeerResult(BaseModel):
    """The worker's result: levels, or the one-line reason vLLM refused the config or failed."""

    model_config = ConfigDict(extra="forbid")
    vllm_version: str | None = None
    torch_threads: int | None = None
    threads_asked: int | None = None  # set on this side: the threads the worker was bound to
    startup_s: float | None = None
    levels: list[PeerLevel] = []
    refused: str | None = None
    failed: str | None = None
    not_run: str | None = None  # set on this side: why the peer was not asked (no export, no counterpart)

    @property
    def problem(self) -> str | None:
        if self.not_run:
            return self.not_run
        if self.refused:
            return f"refused by vLLM: {self.refused}"
        return f"failed in vLLM: {self.failed}" if self.failed else None


def peer_python(args: argparse.Namespace) -> Path:
    """The peer venv's python; a one-line error naming `make peer-vllm` when it is not there."""
    if args.peer not in PEERS:
        raise DraftsmithError(f"--peer {args.peer!r}: the peers are {', '.join(PEERS)}")
    python = Path(args.peer_python) if args.peer_python else DEFAULT_PYTHON
    if not python.is_file():
        raise DraftsmithError(f"--peer vllm: {python} not found; run `make peer-vllm` (vLLM's CPU build in its "
                              "own venv) or pass --peer-python")
    return python


def vllm_config(name: str, config: dict | None, target: Path, workdir: Path) -> dict | str | None:
    """vLLM's speculative_config for a bench row's draftsmith config (None: no speculation), or the one-line
    reason it has none. A head is exported with draftsmith's converter (`--to vllm`) into `workdir`."""
    if config is None:
        return None
    blocked = [key for key in NOT_IN_VLLM if config.get(key)]
    if blocked:
        return f"not compared: vLLM has no {', '.join(blocked)}"
    spec = {key: value for key, value in config.items() if key not in DRAFTSMITH_ONLY_KEYS}
    if spec.get("model"):
        model = Path(spec["model"])
        if resolve_method(spec["method"]).head_type is not None:
            try:
                model = export_head(model, target, workdir / name.replace("@", "-"))
            except DraftsmithError as exc:
                return f"not exported for vLLM: {exc}"
        spec["model"] = str(model.resolve())
    return spec


def export_head(head: Path, target: Path, out: Path) -> Path:
    """`draftsmith convert HEAD OUT --to vllm --target TARGET`, in this process."""
    from draftsmith.convert.cli import run as convert

    convert(argparse.Namespace(src=str(head), out=str(out), from_format=None, to="vllm", target=str(target),
                               dtype=None, force=True, inspect=False))
    return out


def make_job(model_dir: Path, batches: dict[int, list[list[int]]], max_tokens: int, spec: dict | None,
             compiled: bool = False) -> dict:
    """The worker's job: every level's prompts (token ids, in order), greedy, `max_tokens` each; `compiled`:
    vLLM compiles its forward (its default), else it runs eager (enforce_eager)."""
    longest = max(len(ids) for batch in batches.values() for ids in batch)
    return {"model": str(model_dir.resolve()), "max_tokens": max_tokens,
            "max_model_len": max(PEER_MAX_MODEL_LEN, longest + max_tokens), "max_num_seqs": max(batches),
            "speculative_config": spec, "enforce_eager": not compiled,
            "levels": [{"concurrency": c, "prompts": batch} for c, batch in batches.items()]}


class PeerSessions:
    """A `PeerSession` per binding (by name), run round for round: what the bench's matrix holds for a model."""

    def __init__(self):
        self.by_binding: dict[str, PeerSession] = {}

    def run_round(self, concurrency: int) -> None:
        for session in self.by_binding.values():
            session.run_round(concurrency)

    def close(self) -> None:
        for session in self.by_binding.values():
            session.close()


class PeerSession:
    """The peer's workers for one model's methods (`configs`, by row name), each loaded once; `run_round(c)`
    runs one round of level c through each, right after draftsmith's; `results` by method."""

    def __init__(self, python: Path, model_dir: Path, configs: dict[str, dict | None],
                 batches: dict[int, list[list[int]]], max_tokens: int, threads: int, bind: str,
                 worker: Path = WORKER, compiled: bool = False):
        self.tmp = tempfile.TemporaryDirectory(prefix="draftsmith-peer-")
        self.results: dict[str, PeerResult] = {}
        self.workers: dict[str, PeerWorker] = {}
        try:
            for name, config in configs.items():
                self._start(name, config, python, model_dir, batches, max_tokens, threads, bind, worker, compiled)
        except BaseException:
            self.close()
            raise

    def _start(self, name, config, python, model_dir, batches, max_tokens, threads, bind, worker, compiled) -> None:
        workdir = Path(self.tmp.name) / name.replace("@", "-")
        workdir.mkdir()
        spec = vllm_config(name, config, model_dir, workdir)
        if isinstance(spec, str):
            self.results[name] = PeerResult(not_run=spec)
            return
        job = make_job(model_dir, batches, max_tokens, spec, compiled)
        process = PeerWorker(python, job, bind, threads, workdir, worker, pausable=True)
        hello = process.reply()
        if "ready" not in hello:
            process.close()
            self.results[name] = PeerResult(refused=hello.get("refused", json.dumps(hello)))
            return
        self.results[name] = PeerResult(**hello["ready"], threads_asked=None if bind == OWN_BINDING else threads)
        self.workers[name] = process
        process.pause()  # stopped until its rounds (`PeerWorker.pause`)

    def run_round(self, concurrency: int) -> None:
        for name, process in list(self.workers.items()):
            process.resume()
            reply = process.round(concurrency)
            process.pause()
            if "round" not in reply:
                process.close()
                del self.workers[name]
                self.results[name] = PeerResult(failed=reply.get("failed", json.dumps(reply)))
                continue
            _add_round(self.results[name], reply["round"])

    def close(self) -> None:
        for process in self.workers.values():
            process.close()
        self.workers = {}
        self.tmp.cleanup()


def _add_round(result: PeerResult, done: dict) -> None:
    """One round's figures into the result's level (made at its first round, whose ids the level keeps)."""
    level = next((lv for lv in result.levels if lv.concurrency == done["concurrency"]), None)
    if level is None:
        level = PeerLevel(concurrency=done["concurrency"], tokens_per_s=[], whole_run_tokens_per_s=[],
                          outputs=done["outputs"], rounds_equal=True)
        result.levels.append(level)
    level.tokens_per_s.append(done["tokens_per_s"])
    level.whole_run_tokens_per_s.append(done["whole_run_tokens_per_s"])
    level.rounds_equal = level.rounds_equal and done["outputs"] == level.outputs
    level.mean_acceptance_length = done["mean_acceptance_length"]  # greedy: the same each round


def peer_fields(result: PeerResult, c: int, reference: list[list[int]] | None) -> dict:
    """The peer's part of a bench row at level c: its median tokens/s and acceptance, and on how many prompts
    its greedy ids differ from draftsmith's no-speculation ids (`reference`)."""
    if result.problem:
        return {"peer_problem": result.problem}
    level = next((lv for lv in result.levels if lv.concurrency == c), None)
    if level is None:
        return {"peer_problem": f"the vLLM peer returned no level c={c}"}
    mismatches = None if reference is None else sum(a != b for a, b in zip(level.outputs, reference)) + abs(
        len(level.outputs) - len(reference))
    return {"peer_tokens_per_s": statistics.median(level.tokens_per_s),
            "peer_whole_run_tokens_per_s": statistics.median(level.whole_run_tokens_per_s),
            "peer_mean_acceptance_length": level.mean_acceptance_length,
            "peer_greedy_mismatches": mismatches, "peer_greedy_checked": len(level.outputs),
            "peer_rounds_equal": level.rounds_equal}


def merge(rows: list[dict], results: dict[str, PeerResult], references: dict[int, list[list[int]]],
          peer: str) -> list[dict]:
    """Adds the peer's fields to draftsmith's rows of one model (`vs_peer` = draftsmith / vLLM tokens/s)."""
    for row in rows:
        result = results.get(row["method"])
        if result is None:  # a row without a peer counterpart (HF's)
            continue
        row.update(peer=peer, **peer_fields(result, row["concurrency"], references.get(row["concurrency"])))
        if row.get("peer_tokens_per_s"):
            row["vs_peer"] = row["tokens_per_s"] / row["peer_tokens_per_s"]
    return rows


def _summary(result: PeerResult) -> str:
    if result.problem:
        return result.problem
    speeds = ", ".join(f"c={lv.concurrency} {statistics.median(lv.tokens_per_s):.1f} tok/s" for lv in result.levels)
    threads = f"torch threads {result.torch_threads}"
    if result.threads_asked is not None and result.torch_threads not in (None, result.threads_asked):
        threads += f" of {result.threads_asked} asked (not thread for thread)"
    return f"vLLM {result.vllm_version}, {threads}, started in {result.startup_s:.0f} s: {speeds}"


class Peer:
    """The peer engine a bench compares against, set up before anything is timed: its python, and the number
    of threads both engines compute on."""

    def __init__(self, args: argparse.Namespace):
        self.name = args.peer
        self.python = peer_python(args)
        self.threads, cores = bind_threads(args.peer_threads, "--peer-threads")
        self.bindings = parse_bindings(getattr(args, "peer_binding", "threads"), self.threads, cores)
        self.compiled = bool(getattr(args, "peer_compile", False))
        self.version: str | None = None

    def session(self, args: argparse.Namespace, model_dir: Path, configs: dict[str, dict | None],
                batches: dict[int, list[list[int]]]) -> PeerSessions:
        """One model's methods (`configs`, by row name) loaded in the peer at each binding, ready for rounds."""
        sessions = PeerSessions()
        try:
            for binding in self.bindings:
                sessions.by_binding[binding.name] = PeerSession(
                    self.python, model_dir, configs, batches, args.max_tokens, binding.threads, binding.bind,
                    compiled=self.compiled)
        except BaseException:
            sessions.close()
            raise
        return sessions

    def merge(self, model_dir: Path, sessions: PeerSessions, references: dict[int, list[list[int]]],
              rows: list[dict]) -> list[dict]:
        """Each binding's results merged into `rows` (the fastest binding's per row, `peer_bindings.fastest`),
        a line printed per method and binding."""
        merged = {}
        for binding, session in sessions.by_binding.items():
            for name, result in session.results.items():
                at = f" ({binding})" if len(sessions.by_binding) > 1 else ""
                print(f"  vLLM peer {model_dir.name} {name}{at}: {_summary(result)}", flush=True)
                self.version = result.vllm_version or self.version
            merged[binding] = merge([dict(row) for row in rows], session.results, references, self.name)
        return fastest(merged)

    def print_table(self, name: str, rows: list[dict], levels: list[int]) -> None:
        mode = "compiled" if self.compiled else "eager"
        if len(self.bindings) == 1:
            binding = self.bindings[0].title()
        else:
            binding = (f"draftsmith on {self.threads} torch thread(s), vLLM at the fastest of its bindings in each "
                       "cell: " + "; ".join(b.describe() for b in self.bindings))
        print(f"\n{name} against vLLM-CPU {self.version or '?'} ({mode}), {binding}: tok/s draftsmith / vLLM and "
              f"their ratio; acc = mean acceptance length draftsmith/vLLM")
        for line in table_lines(rows, levels):
            print(line, flush=True)


def _cell(row: dict | None) -> str:
    if row is None or not row.get("peer_tokens_per_s"):
        return " " * 26
    return f"{row['tokens_per_s']:>8.1f} / {row['peer_tokens_per_s']:>7.1f} {row['vs_peer']:>5.2f}x"


def _ids(rows: list[dict]) -> str:
    """Whether the peer's greedy ids equal draftsmith's no-speculation ids, over a method's levels."""
    counted = [r for r in rows if r.get("peer_greedy_mismatches") is not None]
    differ = [f"c={r['concurrency']} {r['peer_greedy_mismatches']}/{r['peer_greedy_checked']}" for r in counted
              if r["peer_greedy_mismatches"]]
    if not counted:
        return ""
    return "ids equal" if not differ else "ids differ: " + " ".join(differ)


def table_lines(rows: list[dict], levels: list[int]) -> list[str]:
    """One line per method with a peer row: draftsmith / vLLM tok/s and the ratio at each level, the
    acceptance lengths and the greedy check; a method the peer did not run says why."""
    peer_rows = [r for r in rows if "peer" in r]
    labels = {r["method"]: r["method"] if r["k"] is None else f"{r['method']} k={r['k']}" for r in peer_rows}
    if not labels:
        return []
    width = max(map(len, labels.values())) + 2
    lines = [f"{'method':<{width}}" + "".join(f"{f'c={c}':>26}  " for c in levels) + "acc by c, greedy vs plain"]
    for method, label in labels.items():
        mine = {r["concurrency"]: r for r in peer_rows if r["method"] == method}
        problem = next((r["peer_problem"] for r in mine.values() if r.get("peer_problem")), None)
        if problem:
            lines.append(f"{label:<{width}}{problem}")
            continue
        accept = [f"{r['mean_acceptance_length']:.2f}/{r['peer_mean_acceptance_length']:.2f}" for r in mine.values()
                  if r.get("mean_acceptance_length") is not None and r.get("peer_mean_acceptance_length") is not None]
        lines.append(f"{label:<{width}}" + "".join(f"{_cell(mine.get(c))}  " for c in levels)
                     + " ".join(filter(None, [" ".join(accept) or "-", _ids(list(mine.values())),
                                              _fastest_bindings(mine)])))
    return lines


def _fastest_bindings(rows: dict[int, dict]) -> str:
    """Which of several bindings gave vLLM's figure at each level ("" with one binding)."""
    if all(len(row.get("peer_tokens_per_s_by_binding") or {}) < 2 for row in rows.values()):
        return ""
    return "vLLM's fastest: " + " ".join(f"c={c} {row['peer_binding']}" for c, row in rows.items()
                                         if row.get("peer_binding"))
