"""`draftsmith bench` measures a level over the steps that begin with c requests in flight once the first c
have their first tokens: the final drain, once the queue is empty, is timed apart (it runs below c, and its
length depends on how unevenly requests finish), and so are the first c prefills (in steady state a request
is admitted as one finishes)."""

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
    """Each step takes one second and gives every live request one token, reported that step; a prompt [n]
    wants n tokens, and a prompt [n, p] first prefills for p steps (no token)."""

    def __init__(self, clock: _Clock):
        self.clock, self.live, self.stats = clock, {}, {"num_generated_tokens": 0}
        self.added = 0

    def add_request(self, ids, params):
        request_id, self.added = str(self.added), self.added + 1
        self.live[request_id] = [ids[0], [], ids[1] if len(ids) > 1 else 0]
        return _Request(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.live)

    def step(self):
        self.clock.now += 1.0
        outputs = []
        for request_id, (wanted, tokens, prefill) in list(self.live.items()):
            if prefill:
                self.live[request_id][2] -= 1
                continue
            tokens.append(7)
            self.stats["num_generated_tokens"] += 1
            header = RequestHeader(None, [wanted], 1, None) if len(tokens) == 1 else None
            done = len(tokens) == wanted
            if done:
                del self.live[request_id]
            outputs.append(OutputDelta(request_id, done, [SampleDelta(0, [7], None, "", "length" if done else None,
                                                                      None)], header))
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
    # step 1 gives the first two prompts their first tokens; steps 2-4 begin with 2 in flight (6 tokens); the
    # third prompt, started at step 3, then runs alone to step 8: the whole run is 12 tokens in 8 s
    assert [len(out) for out in run.outputs] == [2, 4, 6]
    assert (run.steady_tokens, run.steady_seconds) == (6, 3.0)
    assert run.tokens_per_s == 2.0 and run.seconds == 8.0


def test_the_first_prefills_are_timed_apart_and_later_ones_in(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(bench.time, "perf_counter", clock)
    run = bench._Run(_FakeLLM(_FakeEngine(clock)), [[3, 4], [6, 2], [2, 4], [9]], None, concurrency=2)
    while not run.done:
        run.step()
    # steps 1-5: the first two prompts prefill (4 and 2 steps), the first's first token comes at step 5;
    # steps 6-13 begin with 2 in flight (12 tokens, the third prompt's 4 prefill steps among them: admitted as
    # the first finished, it is steady state); from step 14 the fourth runs alone. Counted from step 1, the
    # first prefills would have added 5 s and 4 tokens.
    assert [len(out) for out in run.outputs] == [3, 6, 2, 9]
    assert run.steady_seconds > 0 and run.starting == set()
    assert (run.steady_tokens, run.steady_seconds) == (12, 8.0)


def test_a_run_never_at_full_concurrency_reports_the_whole_run(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(bench.time, "perf_counter", clock)
    run = bench._Run(_FakeLLM(_FakeEngine(clock)), [[3]], None, concurrency=2)  # fewer prompts than c
    while not run.done:
        run.step()
    assert run.steady_seconds == 0.0 and run.tokens_per_s == 1.0
