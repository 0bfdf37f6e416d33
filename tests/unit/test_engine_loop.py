"""The one engine loop both clients run (`EngineLoop`): commands between steps, a report per step, a refusal
for a request the engine will not take, an idle report, a stop that lets what is in flight finish, and
faults handed to the client."""

from __future__ import annotations

import pytest

from draftsmith.serve.client.engine_loop import EngineLoop
from draftsmith.serve.client.frames import AbortRequest, AddFailed, AddRequest, StepReport, StopEngine
from draftsmith.serve.engine.sampling_params import SamplingParams

PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


class Script:
    """Feeds the loop commands by how many steps it has reported; records every report."""

    def __init__(self, at_step: dict[int, list]):
        self.at_step, self.reports = at_step, []

    def steps(self) -> int:
        return sum(isinstance(r, StepReport) and bool(r.deltas) for r in self.reports)

    def receive(self, timeout: float) -> list:
        return self.at_step.pop(self.steps(), [])


def _fault(exc):
    raise exc


def test_commands_reports_refusals_and_a_graceful_stop(demo_llm):
    script = Script({0: [AddRequest("a", [1, 2, 3], PARAMS), AddRequest("b", [4, 5], PARAMS),
                         AddRequest("a", [6], PARAMS)],  # an id in use: refused alone
                     2: [AbortRequest("b"), StopEngine(grace_s=60.0)]})
    EngineLoop(demo_llm.engine, script.receive, script.reports.append, _fault).run()
    failed = [r for r in script.reports if isinstance(r, AddFailed)]
    assert [(f.request_id, f.refused) for f in failed] == [("a", True)] and "already in use" in failed[0].message
    deltas = [d for r in script.reports if isinstance(r, StepReport) for d in r.deltas]
    a_tokens = [t for d in deltas if d.request_id == "a" for t in d.samples[0].token_ids]
    assert len(a_tokens) == 6 and [d.finished for d in deltas if d.request_id == "a"][-1]  # ran to its end
    assert not any(d.finished for d in deltas if d.request_id == "b")  # aborted after two steps
    assert not demo_llm.engine.has_unfinished_requests()
    assert all(r.stats is not None for r in script.reports if isinstance(r, StepReport))  # every step (0 s)


def test_an_idle_engine_reports_once_then_waits(demo_llm):
    waits = []
    script = Script({0: [AddRequest("c", [1, 2, 3], PARAMS)]})

    def receive(timeout):
        waits.append(timeout)
        if len(waits) > 20:
            return [StopEngine(0.0)]
        return script.receive(timeout)

    EngineLoop(demo_llm.engine, receive, script.reports.append, _fault, stats_every_s=3600).run()
    idle = [r for r in script.reports if isinstance(r, StepReport) and not r.deltas]
    assert len(idle) == 1 and idle[0].stats.running == 0 and idle[0].stats.metrics["num_generated_tokens"] > 0
    busy = [r for r in script.reports if isinstance(r, StepReport) and r.deltas]
    assert busy[0].stats is not None and all(r.stats is None for r in busy[1:])  # not due again within the hour
    assert waits[0] > 0 and 0 in waits  # an idle loop waits for commands; a busy one only looks


def test_a_step_that_raises_goes_to_the_client_and_the_loop_goes_on(demo_llm, monkeypatch):
    engine = demo_llm.engine
    step, faults = engine.step, []

    def step_failing_once():
        if not faults:
            raise RuntimeError("injected")
        return step()

    monkeypatch.setattr(engine, "step", step_failing_once)
    script = Script({0: [AddRequest("d", [1, 2, 3], PARAMS), StopEngine(60.0)]})
    EngineLoop(engine, script.receive, script.reports.append, faults.append).run()
    assert [str(f) for f in faults] == ["injected"]
    assert sum(len(d.samples[0].token_ids) for r in script.reports if isinstance(r, StepReport) for d in r.deltas) == 6


def test_a_fault_handler_that_raises_ends_the_loop(demo_llm, monkeypatch):
    monkeypatch.setattr(demo_llm.engine, "step", lambda: (_ for _ in ()).throw(RuntimeError("broken")))
    script = Script({0: [AddRequest("e", [1, 2, 3], PARAMS)]})
    with pytest.raises(RuntimeError, match="broken"):
        EngineLoop(demo_llm.engine, script.receive, script.reports.append, _fault).run()
    demo_llm.engine.abort_request("e")
