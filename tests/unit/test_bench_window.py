"""`draftsmith bench` measures a level over the steps that begin with c requests in flight once the first c
have their first tokens, until the last prompt has its first token: the first c prefills are timed apart (in
steady state a request is admitted as one finishes), and so is the end of the run, the final drain included
(it runs below c, its length depends on how unevenly requests finish, and up to it a level whose requests
finish in step would be timed on a whole wave decoded with none prefilled after). The window's tokens are
charged the prefill they owe at the run's prefill seconds per token, not the prefills inside it."""

from collections import Counter
from dataclasses import dataclass

import pytest

from draftsmith.serve.bench import matrix as bench
from draftsmith.serve.bench.turns import TurnOrders
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
    wants n tokens, and a prompt [n, p] first prefills for p steps (no token): a step where any request
    prefills takes a second more, booked as prefill (`stats["prefill_s"]`)."""

    def __init__(self, clock: _Clock):
        self.clock, self.live, self.stats = clock, {}, {"num_generated_tokens": 0, "prefill_s": 0.0}
        self.added = 0

    def add_request(self, ids, params):
        request_id, self.added = str(self.added), self.added + 1
        self.live[request_id] = [ids[0], [], ids[1] if len(ids) > 1 else 0]
        return _Request(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.live)

    def step(self):
        prefilling = [request_id for request_id, (_, _, prefill) in self.live.items() if prefill]
        decoding = [request_id for request_id in self.live if request_id not in prefilling]
        for request_id in prefilling:
            self.live[request_id][2] -= 1
        self.clock.now += self.prefill_seconds(len(prefilling)) + self.decode_seconds(len(decoding))
        self.stats["prefill_s"] += self.prefill_seconds(len(prefilling))
        outputs = []
        for request_id in decoding:
            wanted, tokens, _ = self.live[request_id]
            tokens.append(7)
            self.stats["num_generated_tokens"] += 1
            header = RequestHeader(None, [wanted], 1, None) if len(tokens) == 1 else None
            done = len(tokens) == wanted
            if done:
                del self.live[request_id]
            outputs.append(OutputDelta(request_id, done, [SampleDelta(0, [7], None, "", "length" if done else None,
                                                                      None)], header))
        return outputs

    def prefill_seconds(self, rows: int) -> float:
        return 1.0 if rows else 0.0

    def decode_seconds(self, rows: int) -> float:
        return 1.0 if rows else 0.0


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
    # admitted as the first finished, it is steady state; 2 s of prefill in 6 s); the fourth (last),
    # admitted as the second finished at step 8, has its first token at step 9. Counted from step 1, the
    # first prefills would have added 9 s and 4 tokens. The run's 20 tokens owe 8 s of prefill.
    assert [len(out) for out in run.outputs] == [3, 6, 2, 9]
    assert run.steady_seconds > 0 and run.starting == set()
    assert (run.steady_tokens, run.steady_seconds, run.steady_prefill_seconds) == (6, 6.0, 2.0)
    assert run.prefill_seconds == 8.0
    assert run.tokens_per_s == pytest.approx(6 / (4.0 + 6 * 8 / 20))


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


class _CostedEngine(_FakeEngine):
    """Prefill costs 2 s a request and decoding 0.5 s a row, whatever else the step does: a stream of requests
    of n tokens each then runs at n / (2 + 0.5 n) tokens/s however they finish."""

    def prefill_seconds(self, rows: int) -> float:
        return 2.0 * rows

    def decode_seconds(self, rows: int) -> float:
        return 0.5 * rows


@pytest.mark.parametrize("wanted", [[6] * 12, [10, 3, 3, 3, 2, 10, 12, 2, 2, 3, 3, 2]], ids=["in step", "unevenly"])
def test_the_window_is_charged_the_prefill_its_tokens_owe(monkeypatch, wanted):
    """Requests finishing unevenly (speculation) decode more of the next ones' tokens before the last prompt's
    first token closes the window than requests finishing in step: timed with the prefills inside it, the
    uneven run's window read faster than the stream it stands for; charged what its tokens owe, both read the
    stream's rate."""
    clock = _Clock()
    monkeypatch.setattr(bench.time, "perf_counter", clock)
    run = bench._Run(_FakeLLM(_CostedEngine(clock)), [[n, 1] for n in wanted], None, concurrency=4)
    while not run.done:
        run.step()
    stream = sum(wanted) / (2.0 * len(wanted) + 0.5 * sum(wanted))
    assert run.tokens_per_s == pytest.approx(stream)
    window = run.steady_tokens / run.steady_seconds  # the window's own prefills
    assert window == pytest.approx(stream) if len(set(wanted)) == 1 else window > 1.1 * stream


class _NamedEngine(_FakeEngine):
    """A fake engine that writes its name into `turns` at each step."""

    def __init__(self, clock: _Clock, name: str, turns: list[str]):
        super().__init__(clock)
        self.name, self.turns = name, turns

    def step(self):
        self.turns.append(self.name)
        return super().step()


def test_methods_take_turns_evenly_after_each_other(monkeypatch):
    """Every method follows every other about equally often and never itself (a turn's first steps run on the
    caches the turn before left), each round holds every method once, and a second run takes its turns in the
    same orders."""
    clock = _Clock()
    monkeypatch.setattr(bench.time, "perf_counter", clock)
    monkeypatch.setattr(bench, "SLICE_S", 0.5)  # one fake step (one second) a turn

    def turns_of_a_run() -> list[str]:
        turns: list[str] = []
        llms = {name: _FakeLLM(_NamedEngine(clock, name, turns)) for name in "abcdefg"}
        bench.drive(llms, [[120]], None, concurrency=1)
        return turns

    turns = turns_of_a_run()
    rounds = [turns[i : i + 7] for i in range(0, len(turns), 7)]
    assert len(rounds) == 120 and all(sorted(r) == list("abcdefg") for r in rounds)
    follows = Counter(zip(turns, turns[1:]))
    assert not any(before == after for before, after in follows)
    counts = [follows[(x, y)] for x in "abcdefg" for y in "abcdefg" if x != y]
    # 20 each on average; orders drawn at random spread them 11-28, and 15-21 turns followed their own method
    assert max(counts) - min(counts) <= 2, follows
    assert turns_of_a_run() == turns


def test_turn_orders_stay_even_as_methods_finish():
    """Methods finish at different times: the ones left keep following each other evenly."""
    orders, turns, live = TurnOrders(), [], list("abcdef")
    for round_ in range(90):
        if round_ in (30, 60):
            live = live[:-1]
        order = orders.next_round(live)
        assert sorted(order) == sorted(live)
        turns += order
    follows = Counter(zip(turns, turns[1:]))
    assert not any(before == after for before, after in follows)
    counts = [follows[(x, y)] for x in "abcd" for y in "abcd" if x != y]
    assert max(counts) - min(counts) <= 2, follows


def test_a_speedup_pairs_each_round_with_the_same_rounds_reference():
    """The median of round-by-round ratios: the second round ran slow for every method alike, which a ratio of
    the medians (120 / 100) would read as a 1.2x speedup."""
    assert bench.paired_ratio([120.0, 99.0, 200.0], [100.0, 90.0, 190.0]) == pytest.approx(1.1)
    assert bench.paired_ratio([300.0], [100.0, 200.0, 300.0]) == pytest.approx(1.5)  # not timed round for round
