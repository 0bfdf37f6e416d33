"""What goes over the pipe between the API process and the engine process: length-prefixed frames
(`send_bytes`) of JSON, never pickle, so a frame can only ever be data.

Per step the engine sends each moved request's `OutputDelta` (what it gained since its last report), and
every STATS_EVERY_S its counters for the Prometheus gauges.
"""

from __future__ import annotations

import json

from draftsmith.serve.client.output_streams import OutputDelta, SampleDelta
from draftsmith.serve.engine.logprobs import Logprob


def send(conn, message) -> None:
    conn.send_bytes(json.dumps(message).encode())


def recv(conn):
    return json.loads(conn.recv_bytes())


def _entries(entries: list[dict] | None) -> list | None:
    """Logprob entries ({token: Logprob}, in order) as JSON: [[token, logprob, rank], ...] each."""
    if entries is None:
        return None
    return [None if e is None else [[t, lp.logprob, lp.rank] for t, lp in e.items()] for e in entries]


def _from_entries(entries: list | None) -> list[dict | None] | None:
    if entries is None:
        return None
    return [None if e is None else {t: Logprob(lp, rank) for t, lp, rank in e} for e in entries]


def delta_frame(delta: OutputDelta) -> list:
    """[id, finished, prompt logprobs, [[index, new ids, their logprobs, final text, finish, stop], ...], error]"""
    samples = [[s.index, s.token_ids, _entries(s.logprobs), s.text, s.finish_reason, s.stop_reason]
               for s in delta.samples]
    return [delta.request_id, delta.finished, _entries(delta.prompt_logprobs), samples, delta.error]


def delta_from_frame(frame: list) -> OutputDelta:
    request_id, finished, prompt_logprobs, samples, error = frame
    return OutputDelta(request_id, finished, _from_entries(prompt_logprobs),
                       [SampleDelta(index, ids, _from_entries(logprobs), text, finish, stop)
                        for index, ids, logprobs, text, finish, stop in samples], error)
