"""One request's fault fails that request alone; only a fault of the engine itself ends the engine.

The rules the engine step follows (`LLMEngine.step`):
- What a request brings (its seed, its sampling settings) is tried when it is added (`try_request_row`): a
  failure there is a one-line `DraftsmithError` for that request, and the engine never holds it.
- Per-row host work of a step (stop handling, logprob entries, the final text) runs row by row under
  `RowFaults.guard`: a row that raises is finished with finish reason "error" and its message, the others
  go on.
- Batched work that can fail for one row (drafting, gathering logprobs) is run again row by row once it
  raises (`failing_alone`), to find the rows that fail on their own; those fail, the rest go on. A step whose
  drafting failed decodes its rows without drafts, which is lossless.
- A phase that fails as a whole (a prefill or decode forward) fails the rows of that phase, not the
  engine's other requests. `MAX_CONSECUTIVE_FAULTS` failures of one phase in a row (whatever requests it
  held; drafting counts when it fails for a batch with no row at fault) is an engine fault (`EngineFault`):
  the engine's state is suspect, so an engine process exits for its supervisor to start a fresh one, and an
  engine on a thread fails what is in flight and counts again.
A failed request's samples (n > 1) fail together: a request either answers whole or fails.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from draftsmith.errors import DraftsmithError
from draftsmith.serve.engine.logprobs import token_logprobs
from draftsmith.serve.engine.request import Request, Status
from draftsmith.serve.engine.sampling import SamplingBatch
from draftsmith.serve.engine.sampling_params import SamplingParams

logger = logging.getLogger("draftsmith")

MAX_CONSECUTIVE_FAULTS = 3


class EngineFault(RuntimeError):
    """Phases keep failing whatever rows they hold: the engine itself is broken."""


class RowFaults:
    """The requests a step failed alone, collected for the step to retire and report."""

    def __init__(self):
        self.failed: list[Request] = []
        self.consecutive: dict[str, int] = {}  # per phase: its failures since it last succeeded

    def fail(self, request: Request, phase: str, exc: BaseException) -> None:
        """Fails `request` and its other samples (those finished already keep their answer but the request's
        output carries the error, so it fails whole)."""
        message = f"{phase} failed for this request: {type(exc).__name__}: {exc}"
        request.error = message
        for member in request.group.members if request.group is not None else [request]:
            if member.status is not Status.FINISHED:
                member.finish("error")
                member.error = message
                self.failed.append(member)

    def guard(self, request: Request, phase: str, work: Callable[..., Any], *args) -> Any:
        """work(*args), or None after failing `request` if it raises."""
        try:
            return work(*args)
        except Exception as exc:
            logger.exception("%s failed for request %s; failing it alone", phase, request.request_id)
            self.fail(request, phase, exc)
            return None

    def take(self) -> list[Request]:
        failed, self.failed = self.failed, []
        return failed

    def phase_failed(self, phase: str) -> None:
        self.consecutive[phase] = self.consecutive.get(phase, 0) + 1

    def phase_succeeded(self, phase: str) -> None:
        self.consecutive[phase] = 0

    @property
    def engine_broken(self) -> str | None:
        """The phase that keeps failing, if one has failed MAX_CONSECUTIVE_FAULTS times in a row."""
        return next((phase for phase, n in self.consecutive.items() if n >= MAX_CONSECUTIVE_FAULTS), None)


def failing_alone(faults: RowFaults, rows: list[Request], phase: str, single: Callable[[int], Any]) -> list[Any]:
    """single(i) for each row i, under a guard: the results (None where row i failed, now failed too)."""
    return [faults.guard(row, phase, single, i) for i, row in enumerate(rows)]


def try_request_row(params: SamplingParams, generator_device: torch.device,
                    seeds: list[int]) -> list[torch.Generator]:
    """Builds what a step builds from one request's settings: its samples' generators (returned, for the
    requests to keep) and its sampling row. A request whose values cannot be stepped is refused when added,
    with a DraftsmithError naming what fails (other errors, such as running out of memory, are the engine's
    and propagate)."""
    try:
        generators = [torch.Generator(device=generator_device).manual_seed(seed) for seed in seeds]
        SamplingBatch.build([params] * len(seeds), generators, generator_device, seeds=seeds,
                            positions=[0] * len(seeds))
        return generators
    except (ValueError, OverflowError, TypeError) as exc:
        raise DraftsmithError(f"the request's sampling settings cannot be used ({type(exc).__name__}: {exc})") \
            from None


class FaultIsolatingSteps:
    """The parts of `LLMEngine`'s step that apply the rules above (a mixin: they read the engine's `faults`,
    `stop_checker`, `proposer`, `policy`, `stats` and `config`)."""

    def _phase(self, name: str, rows: list[Request], run) -> list[Request]:
        """run(rows) -> the requests that moved; if it raises, the rows of this phase fail (all of them: rows
        that had finished before the fault keep their answer and are retired too)."""
        try:
            moved = run(rows)
        except Exception as exc:
            logger.exception("%s failed; failing its %d requests", name, len(rows))
            for request in rows:
                if request.status is not Status.FINISHED:
                    self.faults.fail(request, name, exc)
            self.faults.phase_failed(name)
            return list(rows)
        self.faults.phase_succeeded(name)
        return moved

    def _retire(self, request: Request) -> None:
        """A finished (or aborted) request's final text, then its slot freed; if the text raises, the request
        fails (its other samples with it) and is released all the same."""
        try:
            self.stop_checker.finalize_text(request)
        except Exception as exc:
            logger.exception("detokenizing request %s failed; failing it alone", request.request_id)
            if request.finish_reason != "abort":
                request.finish_reason = "error"
                self.faults.fail(request, "detokenizing", exc)
        try:
            self._release(request)
        except Exception:  # a proposer that cannot drop its state for one request: the slot is freed anyway
            logger.exception("releasing request %s failed", request.request_id)
            self._free_slot(request)

    def take_tokens(self, rows: list[Request], new_tokens: list[list[int]], logits: torch.Tensor,
                     sampling: SamplingBatch) -> None:
        """Appends row b's new tokens (chosen at logits[b, j]) up to its stop, with their logprobs; a row whose
        stop handling or logprobs raise fails alone."""
        logprobs = self._logprobs(rows, new_tokens, logits, sampling)
        for request, tokens, entries in zip(rows, new_tokens, logprobs):
            if request.error is not None:
                continue
            appended = self.faults.guard(request, "stop handling", self.stop_checker.append, request, tokens)
            if appended is None:
                continue
            self.stats["num_generated_tokens"] += appended
            if entries is not None:
                request.logprobs += entries[:appended]

    def _logprobs(self, rows: list[Request], new_tokens: list[list[int]], logits: torch.Tensor,
                  sampling: SamplingBatch) -> list:
        """`token_logprobs` for the batch, or row by row once the batch raises (failing the rows that raise)."""
        mode = self.config.logprobs_mode
        try:
            return token_logprobs(rows, new_tokens, logits, sampling, mode)
        except Exception:
            logger.exception("logprobs failed for a batch of %d; retrying its rows alone", len(rows))

        def one(i: int):
            return token_logprobs([rows[i]], [new_tokens[i]], logits[i : i + 1], sampling.select([i]), mode)[0]

        return failing_alone(self.faults, rows, "logprobs", one)

    def propose(self, rows: list[Request], widths: list[int], sampling: SamplingBatch | None,
                stop_below: float = 0.0):
        """The proposer's DraftBatch, or None once it raises, after failing the rows that raise alone."""
        try:
            drafts = self.proposer.propose(rows, widths, sampling, stop_below)
        except Exception:
            logger.exception("drafting failed for a batch of %d; retrying its rows alone", len(rows))
        else:
            self.faults.phase_succeeded("drafting")
            return drafts

        def one(i: int):
            return self.proposer.propose([rows[i]], [widths[i]], None if sampling is None else sampling.select([i]))

        alone = failing_alone(self.faults, rows, "drafting", one)
        if all(r.error is None for r in rows) or all(a is None for a in alone):  # nobody's fault alone
            self.faults.phase_failed("drafting")
        return None

    def _decode_without_drafts(self, rows: list[Request], started: float, draft_s: float) -> None:
        """A step whose drafting raised: its rows that did not fail decode plainly (lossless)."""
        rows = [r for r in rows if r.error is None]
        if rows:
            self.policy.idle([r.slot for r in rows])
            self._plain_decode(rows, started, self._sampling(rows), draft_s)
