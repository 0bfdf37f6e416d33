"""`draftsmith bench --peer vllm` without vLLM: the worker's step loop against a fake vLLM engine, the job and
result protocol against a stand-in worker script, the speculative configs handed to vLLM, and the merged
rows and table. tests/integration/test_bench_peer.py runs the real peer."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from draftsmith.cli import main
from draftsmith.errors import DraftsmithError
from draftsmith.serve.bench import peer
from draftsmith.serve.bench import vllm_peer_worker as worker
from draftsmith.vllm_process import OWN_BINDING
from helpers import REPO


class _Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass
class _Completion:
    token_ids: list[int]


@dataclass
class _Output:
    request_id: str
    finished: bool
    outputs: list[_Completion] = field(default_factory=list)


class _FakeVllmEngine:
    """vLLM's LLMEngine as the worker uses it: each step takes a second and gives every live request one
    token (a prompt [n] wants n; [n, p] first prefills p steps), reported cumulatively under the id it was
    added with."""

    def __init__(self, clock: _Clock):
        self.clock, self.live = clock, {}

    def add_request(self, request_id, prompt, params):
        ids = prompt["prompt_token_ids"]
        self.live[request_id] = [ids[0], [], ids[1] if len(ids) > 1 else 0]
        return f"{request_id}-internal"

    def has_unfinished_requests(self) -> bool:
        return bool(self.live)

    def step(self):
        self.clock.now += 1.0
        outputs = []
        for request_id, (wanted, tokens, prefill) in list(self.live.items()):
            if prefill:
                self.live[request_id][2] -= 1
                continue
            tokens.append(wanted)
            done = len(tokens) == wanted
            if done:
                del self.live[request_id]
            outputs.append(_Output(request_id, done, [_Completion(list(tokens))]))
        return outputs


def test_the_worker_times_the_steps_with_c_in_flight_like_the_bench(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(worker.time, "perf_counter", clock)
    run = worker.StepRun(_FakeVllmEngine(clock), [[2], [4], [6]], None, 2, "c2r0").run()
    # as tests/unit/test_bench_window.py: step 1 gives the first two their first tokens, steps 2-3 begin with 2
    # in flight (4 tokens), the last prompt's first token at step 3 closes the window; the run ends at step 8
    assert run.outputs == [[2, 2], [4] * 4, [6] * 6]
    assert (run.steady_tokens, run.steady_seconds) == (4, 2.0)
    assert run.tokens_per_s == 2.0 and run.whole_run_tokens_per_s == 12 / 8
    # and the first prompts' prefills are timed apart, later ones in (the bench's own case)
    run = worker.StepRun(_FakeVllmEngine(clock), [[3, 4], [6, 2], [2, 4], [9]], None, 2, "c2r1").run()
    assert run.outputs == [[3] * 3, [6] * 6, [2] * 2, [9] * 9]
    assert (run.steady_tokens, run.steady_seconds) == (6, 4.0)


@dataclass
class _Metric:
    name: str
    value: float = 0.0
    values: list = None


def test_acceptance_comes_from_the_spec_decode_counters_between_two_snapshots():
    per_position = "vllm:spec_decode_num_accepted_tokens_per_pos"
    before = worker.spec_counts([_Metric("vllm:spec_decode_num_drafts", 10),
                                 _Metric("vllm:spec_decode_num_accepted_tokens", 5), _Metric("other", 3),
                                 _Metric(per_position, values=[4, 1])])
    # two label sets (engines) of the per-position vector add up, position by position
    after = worker.spec_counts([_Metric("vllm:spec_decode_num_drafts", 30),
                                _Metric("vllm:spec_decode_num_accepted_tokens", 45),
                                _Metric(per_position, values=[20, 10, 2]), _Metric(per_position, values=[4, 3])])
    accepted = worker.acceptance(before, after)
    assert accepted["mean_acceptance_length"] == pytest.approx(1 + 40 / 20)
    assert accepted["acceptance_per_position"] == pytest.approx([20 / 20, 12 / 20, 2 / 20])
    # no drafts: no acceptance, not a division by zero
    assert worker.acceptance(after, after) == {"mean_acceptance_length": None, "acceptance_per_position": []}
    assert worker.one_line(ValueError("Traceback\n  line\nthe reason\n\n")) == "ValueError: the reason"


def test_a_refusal_is_the_first_sentence_of_vllms_pydantic_error():
    import pydantic

    class SpeculativeConfig(pydantic.BaseModel):
        model: str

        @pydantic.model_validator(mode="after")
        def _known(self):
            raise ValueError("The checkpoint has model type `mimo` but Transformers does not recognize this "
                             "architecture. This could be because of an issue with the checkpoint.\n\nYou can...")

    with pytest.raises(pydantic.ValidationError) as caught:
        SpeculativeConfig(model="x")
    assert worker.one_line(caught.value) == ("ValidationError: The checkpoint has model type `mimo` but Transformers "
                                             "does not recognize this architecture.")


FAKE_WORKER = textwrap.dedent("""
    import itertools, json, os, sys
    job = json.load(open(sys.argv[1]))
    env = {k: os.environ.get(k) for k in ("VLLM_CPU_OMP_THREADS_BIND", "OMP_NUM_THREADS", "NUMBA_NUM_THREADS",
                                          "VLLM_TARGET_DEVICE", "VLLM_ENABLE_V1_MULTIPROCESSING")}
    open(sys.argv[1] + ".env", "w").write(json.dumps(env))
    def say(message):
        print("\\nDRAFTSMITH-PEER " + json.dumps(message), flush=True)
    print("INFO vLLM's own chatter")
    if (job["speculative_config"] or {}).get("method") == "mlp_speculator":
        say({"refused": "ValueError: architectures ['MLPSpeculatorPreTrainedModel'] are not supported"})
        sys.exit(0)
    threads = 2 if (job["speculative_config"] or {}).get("method") == "ngram" else 1  # as numba's did
    say({"ready": {"vllm_version": "fake", "torch_threads": threads, "startup_s": 0.1}})
    prompts = {lv["concurrency"]: lv["prompts"] for lv in job["levels"]}
    speeds = itertools.cycle([90.0, 100.0, 120.0])
    for line in sys.stdin:
        c = json.loads(line)["concurrency"]
        say({"round": {"concurrency": c, "tokens_per_s": next(speeds), "whole_run_tokens_per_s": 80.0,
                       "outputs": [ids[:job["max_tokens"]] for ids in prompts[c]],
                       "mean_acceptance_length": 2.5 if job["speculative_config"] else None}})
""")


@pytest.fixture
def fake_worker(tmp_path) -> Path:
    path = tmp_path / "fake_worker.py"
    path.write_text(FAKE_WORKER)
    return path


BATCHES = {1: [[1, 2, 3], [4, 5, 6]], 2: [[1, 2, 3], [4, 5, 6], [7, 8, 9]]}


def _session(fake_worker, configs, bind="0", threads=1) -> peer.PeerSession:
    return peer.PeerSession(Path(sys.executable), REPO / "assets" / "demo-code-7m", configs, BATCHES, 2, threads,
                            bind, worker=fake_worker)


def test_a_job_goes_to_the_worker_and_each_round_comes_back(tmp_path, fake_worker):
    job = peer.make_job(REPO / "assets" / "demo-code-7m", BATCHES, 2, None)
    assert job["max_model_len"] == peer.PEER_MAX_MODEL_LEN and job["max_num_seqs"] == 2
    assert job["enforce_eager"] and not peer.make_job(REPO, BATCHES, 2, None, compiled=True)["enforce_eager"]
    assert [lv["prompts"] for lv in job["levels"]] == [BATCHES[1], BATCHES[2]]
    session = _session(fake_worker, {"none": None, "mlp_speculator": {"method": "mlp_speculator"}})
    try:
        env = json.loads((Path(session.tmp.name) / "none" / "job.json.env").read_text())
        assert env == {"VLLM_CPU_OMP_THREADS_BIND": "0", "OMP_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "1",
                       "VLLM_TARGET_DEVICE": "cpu", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        assert list(session.workers) == ["none"]  # the refusal's worker is gone, its reason kept
        for _ in range(3):
            session.run_round(2)
        session.run_round(1)
        log = (Path(session.tmp.name) / "none" / "worker.log").read_text()
    finally:
        session.close()
    result = session.results["none"]
    assert result.problem is None and result.vllm_version == "fake"
    assert [(lv.concurrency, lv.tokens_per_s) for lv in result.levels] == [(2, [90.0, 100.0, 120.0]), (1, [90.0])]
    assert result.levels[0].outputs == [[1, 2], [4, 5], [7, 8]] and result.levels[0].rounds_equal
    assert "vLLM's own chatter" in log and "DRAFTSMITH-PEER" not in log
    assert session.results["mlp_speculator"].problem == \
        "refused by vLLM: ValueError: architectures ['MLPSpeculatorPreTrainedModel'] are not supported"


def test_a_peer_computing_on_more_threads_than_bound_says_it_is_not_thread_for_thread(fake_worker):
    session = _session(fake_worker, {"none": None, "ngram": {"method": "ngram", "num_speculative_tokens": 4}})
    try:
        session.run_round(1)
    finally:
        session.close()
    assert "torch threads 1, started" in peer._summary(session.results["none"])
    assert "torch threads 2 of 1 asked (not thread for thread)" in peer._summary(session.results["ngram"])


def _state(pid: int) -> str:
    """A process's state letter from /proc (T: stopped)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def _stopped(pid: int, want: bool = True) -> bool:
    """Whether the process is (or, with `want` False, is not) stopped within a few seconds: a signal is
    delivered when the kernel next schedules its target."""
    for _ in range(100):
        if (_state(pid) == "T") == want:
            return True
        time.sleep(0.02)
    return False


PARENT_WORKER = textwrap.dedent("""
    import os, subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    with open(sys.argv[1] + ".child.tmp", "w") as written:  # whole when it appears: a stop may come at once
        written.write(str(child.pid))
    os.replace(sys.argv[1] + ".child.tmp", sys.argv[1] + ".child")
    sys.stdin.read()  # until the end of input
    child.kill()
""")


def _pid_file(path: Path) -> int:
    for _ in range(200):
        if path.exists() and path.read_text():
            return int(path.read_text())
        time.sleep(0.05)
    raise AssertionError(f"{path} never written")


def _gone(pid: int) -> bool:
    try:
        return _state(pid) == "Z"  # exited, not yet reaped by its new parent
    except FileNotFoundError:
        return True


def test_a_paused_worker_stops_with_the_processes_it_started(tmp_path):
    from draftsmith.vllm_process import PeerWorker

    script = tmp_path / "parent_worker.py"
    script.write_text(PARENT_WORKER)
    worker = PeerWorker(Path(sys.executable), {}, "0", 1, tmp_path / "w", script, pausable=True)
    child = _pid_file(tmp_path / "w" / "job.json.child")
    try:
        worker.pause()
        assert _stopped(worker.process.pid) and _stopped(child)
        worker.resume()
        assert _stopped(worker.process.pid, False) and _stopped(child, False)
        worker.pause()
    finally:
        worker.close()  # from stopped
    assert worker.process.poll() is not None


BENCH_THAT_DIES = textwrap.dedent("""
    import os, sys
    from pathlib import Path
    from draftsmith.vllm_process import PeerWorker
    workdir = Path(sys.argv[1])
    worker = PeerWorker(Path(sys.executable), {}, "0", 1, workdir, Path(sys.argv[2]), pausable=True)
    while not (workdir / "job.json.child").exists():
        pass
    worker.pause()
    stat = Path(f"/proc/{worker.process.pid}/stat")
    while stat.read_text().rsplit(")", 1)[1].split()[0] != "T":
        pass  # it dies with the worker stopped, as a bench between rounds
    print(worker.process.pid, flush=True)
    os._exit(1)  # no close, no finally: as a bench killed by SIGKILL or the OOM killer
""")


def test_stopped_workers_do_not_outlive_a_bench_that_dies(tmp_path):
    """The kernel hangs up a stopped process group its parent's death orphans, in the same session only."""
    script, bench = tmp_path / "parent_worker.py", tmp_path / "bench.py"
    script.write_text(PARENT_WORKER)
    bench.write_text(BENCH_THAT_DIES)
    done = subprocess.run([sys.executable, str(bench), str(tmp_path / "w"), str(script)], capture_output=True,
                          text=True, timeout=60, cwd=REPO)
    pid, child = int(done.stdout.split()[0]), _pid_file(tmp_path / "w" / "job.json.child")
    for _ in range(200):
        if _gone(pid):
            break
        time.sleep(0.05)
    assert _gone(pid), f"the stopped worker {pid} outlived its bench (state {_state(pid)})"
    os.kill(child, signal.SIGKILL) if not _gone(child) else None  # its own child is orphaned, not stopped


def test_peer_workers_are_stopped_except_in_their_rounds(fake_worker):
    """Idle vLLM workers poll (gloo threads, its own processes): each is stopped, with its process group,
    from its start to its next round and after it, and closes from there."""
    session = _session(fake_worker, {"none": None})
    try:
        worker = session.workers["none"]
        assert _stopped(worker.process.pid)
        ran = []
        orig_round = worker.round
        worker.round = lambda c: ran.append(_stopped(worker.process.pid, False)) or orig_round(c)
        session.run_round(1)
        assert ran == [True]  # running in its round
        assert _stopped(worker.process.pid)
    finally:
        session.close()
    assert worker.process.poll() is not None  # a stopped worker still closes


def _peer(binding: str, threads: int = 1) -> peer.Peer:
    from draftsmith.cli import build_parser

    args = build_parser().parse_args(["bench", "--peer", "vllm", "--peer-python", sys.executable, "--peer-threads",
                                      str(threads), "--peer-binding", binding, "--max-tokens", "2"])
    saved = torch.get_num_threads()
    try:
        return peer.Peer(args)
    finally:
        torch.set_num_threads(saved)


def test_at_its_own_binding_vllm_starts_with_its_cpu_defaults(fake_worker, monkeypatch, capsys):
    """--peer-binding own: vLLM binds its threads and runs its engine core as it does by default, whatever the
    bench's own environment says, and neither the summary nor the table calls that thread for thread."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0")
    own = _peer("own")
    [binding] = own.bindings
    assert binding.bind == OWN_BINDING and own.threads == 1
    session = _session(fake_worker, {"ngram": {"method": "ngram", "num_speculative_tokens": 4}}, bind=binding.bind)
    try:
        env = json.loads((Path(session.tmp.name) / "ngram" / "job.json.env").read_text())
        session.run_round(1)
    finally:
        session.close()
    assert env == {"VLLM_CPU_OMP_THREADS_BIND": None, "OMP_NUM_THREADS": None, "NUMBA_NUM_THREADS": None,
                   "VLLM_TARGET_DEVICE": "cpu", "VLLM_ENABLE_V1_MULTIPROCESSING": None}
    assert "not thread for thread" not in peer._summary(session.results["ngram"])
    own.print_table("demo-code-7m", [], [1])
    assert "vLLM at its own CPU binding" in capsys.readouterr().out


def test_peer_bindings_parse_in_order_without_repeats():
    from draftsmith.serve.bench.peer_bindings import parse_bindings

    assert [(b.name, b.threads, b.bind) for b in parse_bindings("threads,one,own", 2, "0-1")] == [
        ("threads", 2, "0-1"), ("one", 1, "0"), ("own", 2, OWN_BINDING)]
    assert [b.name for b in parse_bindings("threads, one", 1, "0")] == ["threads"]  # one thread: the same binding
    assert _peer("threads").bindings == parse_bindings("threads", 1, "0")  # the default
    with pytest.raises(DraftsmithError, match="--peer-binding 'threads,all': a comma-separated list of threads, one"):
        parse_bindings("threads,all", 2, "0-1")


def test_each_row_takes_its_fastest_binding(fake_worker, monkeypatch, capsys):
    """Every binding's worker runs every round; a row's peer figures are its fastest binding's, named."""
    speeds = {"0": 50.0, OWN_BINDING: 100.0}  # by the worker's bind: threads (listed first) slow, own fast

    class Fixed(peer.PeerSession):
        def run_round(self, concurrency):
            super().run_round(concurrency)
            for result in self.results.values():
                for level in result.levels:
                    level.tokens_per_s = [speeds[self.bind]] * len(level.tokens_per_s)
                    if self.bind == "0":  # the slow binding's ids differ from draftsmith's on one prompt
                        level.outputs = [[9, 9]] + level.outputs[1:]

    def session(python, model_dir, configs, batches, max_tokens, threads, bind, compiled=False):
        made = Fixed(python, model_dir, configs, batches, max_tokens, threads, bind, worker=fake_worker)
        made.bind = bind
        return made

    monkeypatch.setattr(peer, "PeerSession", session)
    both = _peer("threads,own")
    sessions = both.session(SimpleNamespace(max_tokens=2), REPO / "assets" / "demo-code-7m", {"none": None}, BATCHES)
    try:
        sessions.run_round(1)
    finally:
        sessions.close()
    assert set(sessions.by_binding) == {"threads", "own"}
    reference = {1: [ids[:2] for ids in BATCHES[1]]}  # the fake worker's greedy "ids"
    [row] = both.merge(Path("demo-code-7m"), sessions, reference, [{"method": "none", "concurrency": 1, "k": None,
                                                                   "tokens_per_s": 200.0}])
    assert row["peer_binding"] == "own" and row["peer_tokens_per_s"] == 100.0 and row["vs_peer"] == 2.0
    assert row["peer_tokens_per_s_by_binding"] == {"threads": 50.0, "own": 100.0}
    assert row["peer_greedy_mismatches"] == 1  # the slower binding's mismatch is not hidden by the faster's
    assert "vLLM's fastest: c=1 own" in "\n".join(peer.table_lines([row], [1]))
    both.print_table("demo-code-7m", [row], [1])
    assert "vLLM at the fastest of its bindings in each cell" in capsys.readouterr().out


def test_a_row_no_binding_timed_names_none():
    from draftsmith.serve.bench.peer_bindings import fastest

    failed = {"method": "none", "concurrency": 1, "peer": "vllm", "peer_problem": "failed in vLLM: x"}
    [row] = fastest({"threads": [dict(failed)], "own": [dict(failed)]})
    assert row["peer_binding"] is None and row["peer_tokens_per_s_by_binding"] == {}
    assert peer._fastest_bindings({1: row}) == ""


def test_a_worker_that_dies_without_a_result_is_one_line_naming_its_log(tmp_path):
    dying = tmp_path / "dying.py"
    dying.write_text("import sys\nprint('Segmentation fault in the peer')\nsys.exit(139)\n")
    with pytest.raises(DraftsmithError, match=r"status 139 and no result \(Segmentation fault in the peer\).*"
                                              r"worker\.log"):
        peer.PeerSession(Path(sys.executable), REPO, {"none": None}, BATCHES, 2, 1, "0", worker=dying)


def test_a_worker_that_dies_in_a_round_is_one_line_naming_its_log(tmp_path):
    dying = tmp_path / "dying.py"
    dying.write_text("import sys\nprint('\\nDRAFTSMITH-PEER {\"ready\": {}}', flush=True)\nsys.stdin.readline()\n"
                     "print('killed by the OOM killer', flush=True)\nsys.exit(137)\n")
    session = peer.PeerSession(Path(sys.executable), REPO, {"none": None}, BATCHES, 2, 1, "0", worker=dying)
    try:
        with pytest.raises(DraftsmithError, match=r"status 137 and no result \(killed by the OOM killer\).*"
                                                  r"worker\.log"):
            session.run_round(1)
        with pytest.raises(DraftsmithError, match="status 137"):  # again: no broken pipe, the same line
            session.run_round(1)
    finally:
        session.close()


def _row(method, k, c, speed, accept=None):
    return {"model": "m", "method": method, "k": k, "concurrency": c, "tokens_per_s": speed,
            "mean_acceptance_length": accept}


def test_peer_rows_merge_with_the_ratio_the_greedy_check_and_refusals(tmp_path, fake_worker):
    session = _session(fake_worker, {"none": None, "ngram": {"method": "ngram"},
                                     "mlp_speculator": {"method": "mlp_speculator"}}, "0-1", 2)
    try:
        for c in (1, 2):
            for _ in range(3):
                session.run_round(c)
    finally:
        session.close()
    results = session.results
    results["eagle3-tree"] = peer.PeerResult(not_run="not compared: vLLM has no tree_depth")
    rows = [_row("none", None, 1, 150.0), _row("ngram", 4, 1, 300.0, 3.0), _row("none", None, 2, 200.0),
            _row("ngram", 4, 2, 50.0, 3.0), _row("mlp_speculator", 3, 1, 10.0, 1.5), _row("hf", None, 1, 5.0),
            _row("eagle3-tree", 10, 1, 99.0, 4.0)]
    references = {1: [[1, 2], [4, 5]], 2: [[1, 2], [4, 9], [7, 8]]}  # one prompt differs at c=2
    merged = {(r["method"], r["concurrency"]): r for r in peer.merge(rows, results, references, "vllm")}
    none1, ngram2 = merged["none", 1], merged["ngram", 2]
    assert none1["peer_tokens_per_s"] == 100.0 and none1["vs_peer"] == pytest.approx(1.5)  # median of rounds
    assert none1["peer_greedy_mismatches"] == 0 and merged["none", 2]["peer_greedy_mismatches"] == 1
    assert ngram2["vs_peer"] == pytest.approx(0.5) and ngram2["peer_mean_acceptance_length"] == 2.5
    assert merged["mlp_speculator", 1]["peer_problem"].startswith("refused by vLLM: ValueError")
    assert "peer" not in merged["hf", 1]  # no counterpart: left as it was
    json.dumps(list(merged.values()))  # the --json rows stay plain JSON
    lines = peer.table_lines(list(merged.values()), [1, 2])
    assert lines[0].split() == ["method", "c=1", "c=2", "acc", "by", "c,", "greedy", "vs", "plain"]
    table = "\n".join(lines)
    assert "150.0 /   100.0  1.50x" in table and "ids differ: c=2 1/3" in table
    assert "3.00/2.50 3.00/2.50 ids differ: c=2 1/3" in table
    assert "mlp_speculator k=3  refused by vLLM: ValueError: architectures" in table
    assert "eagle3-tree k=10    not compared: vLLM has no tree_depth" in table


def test_the_speculative_configs_vllm_gets(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)  # where `make bench` names its draft models from
    target = REPO / "assets" / "demo-code-7m"
    assert peer.vllm_config("none", None, target, tmp_path) is None
    ngram = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4,
             "adaptive": False}
    assert peer.vllm_config("ngram", ngram, target, tmp_path) == {k: v for k, v in ngram.items() if k != "adaptive"}
    tree = {"method": "eagle3", "model": "assets/demo-code-7m-eagle3", "tree_depth": 5, "tree_top_k": 2}
    assert peer.vllm_config("eagle3-tree", tree, target, tmp_path) == "not compared: vLLM has no tree_depth, tree_top_k"
    draft = {"method": "draft_model", "model": "assets/demo-code-7m", "num_speculative_tokens": 4}
    # a draft model is a plain model: vLLM loads it as it is, by an absolute path
    assert peer.vllm_config("draft_model", draft, target, tmp_path) == {**draft, "model": str(target.resolve())}


def test_a_shipped_head_is_exported_with_draftsmith_convert(tmp_path):
    head = REPO / "assets" / "demo-code-7m-eagle3"
    spec = peer.vllm_config("eagle3", {"method": "eagle3", "model": str(head), "num_speculative_tokens": 5},
                            REPO / "assets" / "demo-code-7m", tmp_path)
    config = json.loads((Path(spec["model"]) / "config.json").read_text())
    assert spec["method"] == "eagle3" and Path(spec["model"]).parent == tmp_path
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]  # --to vllm's layout


def test_a_missing_peer_venv_is_one_line_naming_make_peer_vllm(tmp_path, capsys):
    assert main(["bench", "--peer", "vllm", "--peer-python", str(tmp_path / "none" / "python"), "--no-plot"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "run `make peer-vllm`" in err


def test_both_engines_get_the_same_threads():
    threads, affinity = torch.get_num_threads(), os.sched_getaffinity(0)
    try:
        assert peer.bind_threads(1) == (1, "0") and torch.get_num_threads() == 1
        assert os.sched_getaffinity(0) == affinity  # only vLLM is pinned
        if {0, 1} <= affinity:
            assert peer.bind_threads(2) == (2, "0-1") and torch.get_num_threads() == 2
        with pytest.raises(DraftsmithError, match="--peer-threads 4096: cores 0-4095 are not all available"):
            peer.bind_threads(4096, "--peer-threads")  # as the bench calls it
    finally:
        torch.set_num_threads(threads)


def test_data_parallel_ranks_split_the_cores_evenly():
    from draftsmith.vllm_process import split_cores

    assert split_cores("0-1", 2) == ["0", "1"] and split_cores("0-3", 1) == ["0-3"]
    assert split_cores("0-6", 2) == ["0-2", "3-6"]  # every core used
    assert split_cores("0-7", 3) == ["0-1", "2-4", "5-7"]
    with pytest.raises(DraftsmithError, match="3 data-parallel ranks need a core each; 2 threads given"):
        split_cores("0-1", 3)


def test_peer_compile_reaches_the_workers_job(fake_worker):
    """--peer-compile lets vLLM compile (its default); without it the peer runs eager, as draftsmith on CPU."""
    from draftsmith.cli import build_parser

    session = peer.PeerSession(Path(sys.executable), REPO / "assets" / "demo-code-7m", {"none": None}, BATCHES, 2, 1,
                               "0", worker=fake_worker, compiled=True)
    try:
        job = json.loads((Path(session.tmp.name) / "none" / "job.json").read_text())
    finally:
        session.close()
    assert job["enforce_eager"] is False
    assert build_parser().parse_args(["bench", "--peer", "vllm", "--peer-compile"]).peer_compile
    assert not build_parser().parse_args(["bench", "--peer", "vllm"]).peer_compile
