"""The standing fuzz (`tests/fuzz_server.py`), bounded to about a minute: boundary values in every field of
every endpoint against a live speculating server with an engine process, a canary streaming beside them;
no 5xx, the canary's output unchanged, the engine the one that started. `make fuzz-serve` runs 10,000."""

from __future__ import annotations

import httpx
import pytest

pytest.importorskip("hypothesis", reason="hypothesis is not installed (schemathesis, a [dev] dependency, brings it)")

from fuzz_server import SERVER_KWARGS, plain_canary, run_fuzz  # noqa: E402

from draftsmith.serve.openai.cli import build_process_server_app, server_in_thread  # noqa: E402

EXAMPLES = 150


def test_boundary_values_everywhere_give_no_5xx_and_leave_the_canary_and_engine_alone():
    expected = plain_canary()
    app = build_process_server_app(SERVER_KWARGS, "demo")
    with server_in_thread(app) as url:
        engine = app.state.engine
        pid = engine.process.pid
        tally = run_fuzz(url, EXAMPLES, expected)
        assert not tally.server_errors, "\n".join(tally.server_errors[:10])
        assert tally.canary_runs > 0 and not tally.canary_changes, tally.canary_changes[:2]
        assert sum(tally.statuses.values()) == EXAMPLES
        assert {200, 400} <= set(tally.statuses)  # it reached the engine and the validators both
        assert engine.healthy and engine.process.pid == pid and not engine.restarted_at
        assert httpx.get(f"{url}/health").status_code == 200
