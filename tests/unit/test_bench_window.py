"""`draftsmith bench` measures a level over the steps that begin with c requests in flight: the final drain,
once the queue is empty, is timed apart (it runs below c, and its length depends on how unevenly requests
finish)."""

from dataclasses import dataclass

from draftsmith.serve.bench import matrix as bench
from draftsmith.serve.engine.outputs import OutputDelta, RequestHeader, SampleDelta


@dataclass
class _Request:
    request_id: str


class _Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


class _FakeEngine:
    """Each step takes one second and gives every live request one token; a prompt [n] wants n tokens."""

    def __init__(self, clock: _Clock):
        self.clock, self.live, self.stats = clock, {}, {"num_generated_tokens": 0}
        self.added = 0

    def add_request(self, ids, params):
        request_id, self.added = str(self.added), self.added + 1
        self.live[request_id] = [ids[0], []]
        return _Request(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.live)

    def step(self):
        self.clock.now += 1.0
        outputs = []
        for request_id, (wanted, tokens) in list(self.live.items()):
            tokens.append(7)
            self.stats["num_generated_tokens"] += 1
            if len(tokens) == wanted:
                del self.live[request_id]
                header = RequestHeader(None, [wanted], 1, None)  # its one report: the first and the last
                outputs.append(OutputDelta(request_id, True, [SampleDelta(0, tokens, None, "", "length", None)], header))
        return outputs


class _FakeLLM:
    def __init__(self, engine):
        self.engine = engine


def test_the_drain_is_timed_apart(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(bench.time, "perf_counter", clock)
    run = bench._Run(_FakeLLM(_FakeEngine(clock)), [[2], [4], [6]], None, concurrency=2)
    while not run.done:
        run.step()
    # steps 1-4 begin with 2 in flight (8 tokens); the third prompt, started at step 3, then runs alone to
    # step 8: the whole run is 12 tokens in 8 s
    assert [len(out) for out in run.outputs] == [2, 4, 6]
    assert (run.steady_tokens, run.steady_seconds) == (8, 4.0)
    assert run.tokens_per_s == 2.0 and run.seconds == 8.0


def test_a_run_never_at_full_concurrency_reports_the_whole_run(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(bench.time, "perf_counter", clock)
    run = bench._Run(_FakeLLM(_FakeEngine(clock)), [[3]], None, concurrency=2)  # fewer prompts than c
    while not run.done:
        run.step()
    assert run.steady_seconds == 0.0 and run.tokens_per_s == 1.0
