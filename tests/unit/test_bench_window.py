"""`draftsmith bench` measures a level over the steps that begin with c requests in flight once the first c
have their first tokens, until the last prompt has its first token: the first c prefills are timed apart (in
steady state a request is admitted as one finishes), and so is the end of the run, the final drain included
(it runs below c, its length depends on how unevenly requests finish, and up to it a level whose requests
finish in step would be timed on a whole wave decoded with none prefilled after)."""

from dataclasses import dataclass

import pytest

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
    # step 1 gives the first two prompts their first tokens; steps 2-3 begin with 2 in flight (4 tokens); the
    # third (last) prompt, admitted as the first finished at step 2, has its first token at step 3, which
    # closes the window; it then runs to step 8 (alone from step 5): the whole run is 12 tokens in 8 s
    assert [len(out) for out in run.outputs] == [2, 4, 6]
    assert (run.steady_tokens, run.steady_seconds) == (4, 2.0)
    assert run.tokens_per_s == 2.0 and run.seconds == 8.0


def test_the_first_prefills_are_timed_apart_and_later_ones_in(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(bench.time, "perf_counter", clock)
    run = bench._Run(_FakeLLM(_FakeEngine(clock)), [[3, 4], [6, 2], [2, 4], [9]], None, concurrency=2)
    while not run.done:
        run.step()
    # steps 1-5: the first two prompts prefill (4 and 2 steps), the first's first token comes at step 5;
    # steps 6-9 begin with 2 in flight (6 tokens, the third prompt's first 2 prefill steps among them:
    # admitted as the first finished, it is steady state); the fourth (last), admitted as the second
    # finished at step 8, has its first token at step 9. Counted from step 1, the first prefills would have
    # added 5 s and 4 tokens.
    assert [len(out) for out in run.outputs] == [3, 6, 2, 9]
    assert run.steady_seconds > 0 and run.starting == set()
    assert (run.steady_tokens, run.steady_seconds) == (6, 4.0)


def test_a_run_never_at_full_concurrency_reports_the_whole_run(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(bench.time, "perf_counter", clock)
    run = bench._Run(_FakeLLM(_FakeEngine(clock)), [[3]], None, concurrency=2)  # fewer prompts than c
    while not run.done:
        run.step()
    assert run.steady_seconds == 0.0 and run.tokens_per_s == 1.0


def test_the_window_holds_as_many_prefills_as_requests_finished(monkeypatch):
    """Requests finishing in step (plain decoding, equal max_tokens) or unevenly (speculation): either way
    the window closes at the last prompt's first token, when as many requests were admitted (and prefilled)
    in it as finished in it; up to the drain, the in-step level was timed on its last wave decoded whole
    with no prefill after it (4 admitted, 6 finished here)."""
    clock = _Clock()
    monkeypatch.setattr(bench.time, "perf_counter", clock)
    for wanted in ([4] * 6, [8, 5, 8, 5, 2, 4]):
        engine = _FakeEngine(clock)
        run = bench._Run(_FakeLLM(engine), [[n, 2] for n in wanted], None, concurrency=2)
        admitted = finished = 0
        while not run.done:
            before = (run.steady_seconds, engine.added, sum(out is not None for out in run.outputs))
            run.step()
            if run.steady_seconds > before[0]:  # a step in the window
                admitted += engine.added - before[1]
                finished += sum(out is not None for out in run.outputs) - before[2]
        assert run.ended and admitted == finished == len(wanted) - 2


class _NamedEngine(_FakeEngine):
    """A fake engine that writes its name into `turns` at each step."""

    def __init__(self, clock: _Clock, name: str, turns: list[str]):
        super().__init__(clock)
        self.name, self.turns = name, turns

    def step(self):
        self.turns.append(self.name)
        return super().step()


def test_methods_take_turns_in_a_new_order_each_round(monkeypatch):
    """No method always follows the same one (a turn's first steps run on the caches the turn before left), and
    a second run takes its turns in the same orders."""
    clock = _Clock()
    monkeypatch.setattr(bench.time, "perf_counter", clock)
    monkeypatch.setattr(bench, "SLICE_S", 0.5)  # one fake step (one second) a turn

    def turns_of_a_run() -> list[str]:
        turns: list[str] = []
        llms = {name: _FakeLLM(_NamedEngine(clock, name, turns)) for name in "abcd"}
        bench.drive(llms, [[120]], None, concurrency=1)
        return turns

    turns = turns_of_a_run()
    rounds = [turns[i : i + 4] for i in range(0, len(turns), 4)]
    assert len(rounds) == 120 and all(sorted(r) == list("abcd") for r in rounds)
    leads = {name: sum(r[0] == name for r in rounds) for name in "abcd"}
    assert all(15 <= n <= 45 for n in leads.values()), leads  # 30 each on average
    follows = {(before, after) for before, after in zip(turns, turns[1:]) if before != after}
    assert follows == {(x, y) for x in "abcd" for y in "abcd" if x != y}
    assert turns_of_a_run() == turns


def test_a_speedup_pairs_each_round_with_the_same_rounds_reference():
    """The median of round-by-round ratios: the second round ran slow for every method alike, which a ratio of
    the medians (120 / 100) would read as a 1.2x speedup."""
    assert bench.paired_ratio([120.0, 99.0, 200.0], [100.0, 90.0, 190.0]) == pytest.approx(1.1)
    assert bench.paired_ratio([300.0], [100.0, 200.0, 300.0]) == pytest.approx(1.5)  # not timed round for round
