"""Prometheus metrics for the server, named like vLLM's with the `draftsmith:` prefix.

Each server owns its CollectorRegistry, so several servers in one process (tests, benchmarks) never
collide. Engine counters are mirrored by adding the difference since the last step.
"""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

from draftsmith.acceptance_record import Acceptance
from draftsmith.serve.openai.acceptance_drift import WINDOW_DRAFTS, AcceptanceDrift

# `*_created` timestamp series double the output and no dashboard reads them.
disable_created_metrics()

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                   10.0, 20.0, 40.0, 80.0)


class ServerMetrics:
    def __init__(self, model_name: str, num_speculative_tokens: int = 0, record: Acceptance | None = None):
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r = self.registry
        self.request_success = Counter("draftsmith:request_success", "Finished requests by finish reason",
                                       labels + ["finished_reason"], registry=r)
        self.request_failure = Counter("draftsmith:request_failure", "Requests rejected or failed, by HTTP status",
                                       labels + ["status"], registry=r)
        self.engine_restarts = Counter("draftsmith:engine_restarts", "Engine processes started after one died",
                                       labels, registry=r)
        self.prompt_tokens = Counter("draftsmith:prompt_tokens", "Prefilled prompt tokens", labels, registry=r)
        self.generation_tokens = Counter("draftsmith:generation_tokens", "Generated tokens", labels, registry=r)
        self.running = Gauge("draftsmith:num_requests_running", "Requests holding a KV slot", labels, registry=r)
        self.waiting = Gauge("draftsmith:num_requests_waiting", "Requests queued for a slot", labels, registry=r)
        self.ttft = Histogram("draftsmith:time_to_first_token_seconds", "Time to first token", labels,
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("draftsmith:inter_token_latency_seconds", "Time between streamed outputs per token",
                             labels, buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("draftsmith:e2e_request_latency_seconds", "End-to-end request latency", labels,
                             buckets=LATENCY_BUCKETS, registry=r)
        self.spec_drafts = Counter("draftsmith:spec_decode_num_drafts", "Speculative drafts", labels, registry=r)
        self.spec_draft_tokens = Counter("draftsmith:spec_decode_num_draft_tokens", "Draft tokens proposed",
                                         labels, registry=r)
        self.spec_accepted = Counter("draftsmith:spec_decode_num_accepted_tokens", "Draft tokens accepted",
                                     labels, registry=r)
        self.spec_per_pos = Counter("draftsmith:spec_decode_num_accepted_tokens_per_pos",
                                    "Accepted draft tokens by position", labels + ["position"], registry=r)
        self.spec_drafted_per_pos = Counter("draftsmith:spec_decode_num_draft_tokens_per_pos",
                                            "Drafts that reached each position", labels + ["position"], registry=r)
        self.spec_chosen_k = Counter("draftsmith:spec_decode_chosen_k",
                                     "Requests x decode steps by the draft limit the policy gave them", labels + ["k"],
                                     registry=r)
        self.spec_plain_steps = Counter("draftsmith:spec_decode_steps_without_speculation",
                                        "Decode steps the policy ran without drafting", labels, registry=r)
        # what a proposer reports of its own state (`Proposer.metrics`): suffix decoding's trees
        self.proposer_gauges = {
            "suffix_cache_bytes": Gauge("draftsmith:suffix_cache_bytes", "Memory the suffix trees hold (about)",
                                        labels, registry=r),
            "suffix_cached_requests": Gauge("draftsmith:suffix_cached_requests",
                                            "Requests whose outputs the global suffix tree holds", labels, registry=r)}
        self.model_name = model_name
        for position in range(num_speculative_tokens):  # exported from the start, at 0
            self.spec_per_pos.labels(model_name, str(position))
            self.spec_drafted_per_pos.labels(model_name, str(position))
        self.drift = self._drift_metrics(record) if record else None
        self._last: dict = {}

    def _drift_metrics(self, record: Acceptance) -> AcceptanceDrift:
        """The head's record per position, and gauges for the live figure beside it (`acceptance_drift`)."""
        r, labels = self.registry, ["model_name", "position"]
        recorded = Gauge("draftsmith:spec_decode_record_acceptance_rate",
                         f"The head's record: how often each draft position was accepted ({record.source})", labels,
                         registry=r)
        for position, rate in enumerate(record.per_position):
            recorded.labels(self.model_name, str(position)).set(rate)
        self.spec_live_rate = Gauge("draftsmith:spec_decode_live_acceptance_rate",
                                    f"How often each draft position was accepted over the newest {WINDOW_DRAFTS} "
                                    "drafts", labels, registry=r)
        self.spec_below_record = Gauge("draftsmith:spec_decode_below_record",
                                       "1 while live acceptance stays below the share of the record the gate asks",
                                       ["model_name"], registry=r)
        self.spec_below_record.labels(self.model_name).set(0)
        return AcceptanceDrift(record)

    def observe(self, running: int, waiting: int, now: dict) -> None:
        """The engine's request counts and cumulative `get_metrics()`, however they arrive (a thread's engine,
        or an engine process's reports)."""
        name = self.model_name
        self.running.labels(name).set(running)
        self.waiting.labels(name).set(waiting)
        for key, counter in (("num_prompt_tokens", self.prompt_tokens),
                             ("num_generated_tokens", self.generation_tokens),
                             ("num_drafts", self.spec_drafts), ("num_draft_tokens", self.spec_draft_tokens),
                             ("num_accepted_tokens", self.spec_accepted),
                             ("num_steps_without_speculation", self.spec_plain_steps)):
            if key in now:
                counter.labels(name).inc(now[key] - self._last.get(key, 0))
        for key, counter in (("accepted_per_position", self.spec_per_pos),
                             ("drafted_per_position", self.spec_drafted_per_pos)):
            for position, count in enumerate(now.get(key, [])):
                previous = self._last.get(key, [0] * (position + 1))
                counter.labels(name, str(position)).inc(count - previous[position])
        if self.drift is not None and self.drift.observe(now.get("accepted_per_position", []),
                                                         now.get("drafted_per_position", [])):
            for position, rate in enumerate(self.drift.live):
                self.spec_live_rate.labels(name, str(position)).set(rate)
            self.spec_below_record.labels(name).set(int(self.drift.below_record))
        for k, count in enumerate(now.get("spec_k_histogram", [])):
            previous = self._last.get("spec_k_histogram", [0] * (k + 1))
            self.spec_chosen_k.labels(name, str(k)).inc(count - previous[k])
        for key, gauge in self.proposer_gauges.items():
            if key in now:
                gauge.labels(name).set(now[key])
        self._last = now

    def engine_restarted(self) -> None:
        """A fresh engine process counts from zero: its reports are new baselines, not decreases."""
        self.engine_restarts.labels(self.model_name).inc()
        self._last = {}
        self.running.labels(self.model_name).set(0)
        self.waiting.labels(self.model_name).set(0)

    def render(self) -> bytes:
        return generate_latest(self.registry)
