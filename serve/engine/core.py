"""The engine loop: continuous batching over a per-slot KV cache.

Each `step()` (1) gives free cache slots to waiting requests, (2) runs one chunked, padded prefill forward
for requests still reading their prompt and samples the first token of those that finish it, and (3) runs
one decode forward for every request already generating (`speculative_step` when speculating). Requests
finish independently and free their slot at once, so queued ones join on the next step. The only
device-to-host copy per forward is the sampled token ids, which stop checks need anyway; a speculative step
adds the draft counts before its forward, because the host sizes the verify batch from them.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections import deque
from dataclasses import dataclass

import torch

from draftsmith.errors import DraftsmithError
from draftsmith.methods import DraftBatch, SpeculativeConfig, resolve_method
from draftsmith.models.draft_step_cpu import FusedDraftSteps
from draftsmith.models.kernel_backend import slot_kernel_wanted
from draftsmith.models.kv_cache import ForwardBatch
from draftsmith.models.linear import warm_up as warm_up_linears
from draftsmith.models.llama import CausalLM
from draftsmith.models.tokenizer import check_same_vocabulary
from draftsmith.serve.engine.checks import CheckedRequest, RequestLimits
from draftsmith.serve.engine.forced_tokens import MAX_FORCED, forced_limits, forced_step
from draftsmith.serve.engine.logits_processing import SlotLogitsState
from draftsmith.serve.engine.logprobs import LOGPROBS_MODES, prompt_logprobs
from draftsmith.serve.engine.outputs import OutputDelta
from draftsmith.serve.engine.request import Request, RequestGroup, Status
from draftsmith.serve.engine.row_faults import (
    MAX_CONSECUTIVE_FAULTS,
    EngineFault,
    FaultIsolatingSteps,
    RowFaults,
    try_request_row,
)
from draftsmith.serve.engine.sampling import SamplingBatch, sample
from draftsmith.serve.engine.sampling_params import SamplingParams, wrap_int64
from draftsmith.serve.engine.speculative_step import (
    draft_limits,
    finish_step,
    plan_and_propose,
    verify_drafts,
)
from draftsmith.serve.engine.step_accounting import StepLedger
from draftsmith.serve.engine.step_clock import StepClock
from draftsmith.serve.engine.step_graphs import DraftStepRunner, make_step_runner, resolve_step_mode
from draftsmith.serve.engine.stopping import StopChecker
from draftsmith.serve.speculation.cost_profile import ForwardCostTable
from draftsmith.serve.speculation.policy import make_policy
from draftsmith.serve.speculation.verify import SpecMetrics, pick_sampler

logger = logging.getLogger("draftsmith")


WARM_UP_ROWS = 256  # row counts whose linear kernels the engine compiles at start, at most


@dataclass
class EngineConfig:
    max_num_seqs: int = 16  # cache slots = requests decoding at once
    max_model_len: int = 2048  # prompt + output tokens per request
    max_num_batched_tokens: int = 2048  # padded prefill tokens per step
    seed: int = 0
    logprobs_mode: str = "raw_logprobs"  # vLLM's names: raw_logprobs or processed_logprobs (serve.engine.logprobs)
    # how decode and verify forwards run (serve.engine.step_graphs): auto = CUDA graphs on CUDA, eager elsewhere
    step_mode: str = "auto"
    enforce_eager: bool = False  # vLLM's flag: every forward eager (step_mode auto or eager only)
    # time every decode step's parts on the device (`step_clock`): the step profile then holds device time on
    # CUDA too, at the price of a synchronize per part; an adaptive policy times its steps whatever this says
    profile_steps: bool = False

    def __post_init__(self) -> None:
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise DraftsmithError(f"logprobs_mode {self.logprobs_mode!r}: one of {', '.join(LOGPROBS_MODES)}")


class LLMEngine(FaultIsolatingSteps):
    def __init__(self, model: CausalLM, tokenizer, config: EngineConfig, eos_token_ids: set[int],
                 spec_config: SpeculativeConfig | None = None, cost_table: ForwardCostTable | None = None):
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        self.device = model.model.embed_tokens.weight.device
        # on CPU, builds (or loads) the C++ kernels now, not in a request, and before anything sizes itself by
        # them: linear layers' plans (the panel GEMM) and a head's draft dtype (`methods.heads.draft_dtype`)
        slot_kernel_wanted(self.device)
        self.cache = model.make_cache(config.max_num_seqs, config.max_model_len)
        self.stop_checker = StopChecker(tokenizer, eos_token_ids, config.max_model_len)
        self.logits_state = SlotLogitsState(config.max_num_seqs, model.config.vocab_size, self.device, eos_token_ids,
                                            tokenizer)
        self.free_slots = list(range(config.max_num_seqs))
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.groups: dict[str, RequestGroup] = {}  # n > 1: the samples of one request, by its id
        self._ids = itertools.count()
        self._seed_source = torch.Generator().manual_seed(config.seed)
        # num_forced_tokens: tokens grammar drafts gave beyond one a forward (`forced_tokens`); prefill_s: wall
        # seconds of the steps' prefill phases (what `draftsmith bench` charges each generated token its share of)
        self.stats = {"num_prompt_tokens": 0, "num_generated_tokens": 0, "num_forward_passes": 0, "num_forced_tokens": 0,
                      "prefill_s": 0.0}
        self.faults = RowFaults()  # requests a step failed alone (`row_faults` has the rules)
        self.ledger = StepLedger()
        self.spec_config = spec_config
        self.proposer = None
        if spec_config is not None:  # resolved once; the engine never branches on the method name
            method = resolve_method(spec_config.method)
            self.proposer = method.proposer_class()(spec_config, model, config.max_num_seqs, config.max_model_len)
            if self.proposer.tokenizer_dir is not None and tokenizer is not None:
                check_same_vocabulary(tokenizer, self.proposer.tokenizer_dir, "draft model")
            self.rejection_sampler = pick_sampler(self.device)
            self.spec_metrics = SpecMetrics(spec_config.num_speculative_tokens)
            self.sample_drafts = spec_config.draft_sample_method == "probabilistic"
        # target layers the proposer reads (EAGLE: last, EAGLE-3: three): the method declares that it reads
        # some, its proposer (from the loaded head) says which
        self.feature_layers: tuple[int, ...] = ()
        if self.proposer is not None and method.needs.hidden_states:
            self.feature_layers = tuple(self.proposer.feature_layers)
        elif self.proposer is not None and self.proposer.feature_layers:
            raise ValueError(f"{method.__name__} reads target layers but does not declare needs.hidden_states")
        logger.info("KV cache: %d slots x %d tokens, %.1f MiB (%s)", config.max_num_seqs, config.max_model_len,
                    self.cache.nbytes / 2**20, self.cache.k[0].dtype)
        # the row counts of decode and verify steps; a prompt's compile when it comes
        k = spec_config.num_speculative_tokens if spec_config is not None else 0
        drafters = self.proposer.draft_models() if self.proposer is not None else []
        warm_up_linears([model, *drafters], min(config.max_num_seqs * (k + 1), WARM_UP_ROWS))
        self.step_mode = resolve_step_mode(config.step_mode, config.enforce_eager, self.device)
        self.steps = make_step_runner(model, self.cache, config.max_num_seqs, self.feature_layers, self.step_mode)
        # grammar drafts per step at most: with captured steps, only the widths warmed below (chains' verifies)
        tree = self.proposer is not None and self.proposer.tree is not None
        self.max_forced = MAX_FORCED if self.steps is None else 0 if tree else k
        if self.steps is not None:
            # decode, and chains' verifies of 1..k drafts (a tree's verify runs eager: tree_verify)
            buckets = self.steps.warm_up([1] if tree else list(range(1, k + 2)))
            logger.info("decode and verify steps: %s, %d buckets ready", self.step_mode, buckets)
            # trees draft with steps of their own widths (tree_drafting): no one-token steps to ready
            runner = self.proposer.use_static_steps(
                lambda head, cache: DraftStepRunner(head, cache, config.max_num_seqs, self.step_mode),
            ) if self.proposer is not None and not tree and k > 1 else None
            if runner is not None:
                logger.info("draft steps: %s, %d buckets ready", self.step_mode, runner.warm_up())
        elif self.proposer is not None and not tree and k > 1:
            # eager on CPU: a head whose forwards the fused C++ op runs takes it (models.draft_step_cpu)
            if self.proposer.use_static_steps(FusedDraftSteps.for_head) is not None:
                logger.info("draft steps and catch-up: one C++ op each")
        if spec_config is not None:  # after the draft steps' runner: the policy may time its steps (`draft_timer`)
            self.policy = make_policy(spec_config, self.proposer, config.max_num_seqs, cost_table, model)
            logger.info("speculation: %s, k=%d, %s drafts, rejection sampler %s", spec_config.method,
                        spec_config.num_speculative_tokens, spec_config.draft_sample_method,
                        self.rejection_sampler.__name__)
        timed = self.proposer is not None and self.policy.needs_timing
        self.clock = StepClock(self.device, timed or config.profile_steps)

    # ----------------------------------------------------------------------------------------- requests
    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None,
                    prompt: str | None = None) -> Request | RequestGroup:
        """Checks a request (`limits`) and queues it (`add`)."""
        params = params.with_tokenizer(self.tokenizer)
        return self.add(self.limits.check(prompt_token_ids, params, prompt), request_id)

    def add(self, checked: CheckedRequest, request_id: str | None = None) -> Request | RequestGroup:
        """Queues a checked request; with params.n > 1, a group of n samples (ids `{request_id}:{i}`, seeds
        params.seed + i, as vLLM seeds them) admitted together, whose prompt is prefilled once."""
        prompt_token_ids, params, prompt = checked.prompt_token_ids, checked.params, checked.prompt
        if params.stop and self.tokenizer is None:
            raise DraftsmithError("stop strings need a tokenizer, and this engine has none (skip_tokenizer_init)")
        if params.top_k >= self.model.config.vocab_size:  # keeps every token: the filter is off
            params = dataclasses.replace(params, top_k=-1)
        request_id = request_id if request_id is not None else str(next(self._ids))
        n = params.n
        ids = [request_id] if n == 1 else [f"{request_id}:{i}" for i in range(n)]
        taken = [i for i in (request_id, *ids) if i in self.requests or i in self.groups]
        if taken:
            raise DraftsmithError(f"request id {taken[0]!r} is already in use")
        seed = params.seed if params.seed is not None else int(
            torch.randint(0, 2**62, (1,), generator=self._seed_source))
        seeds = [wrap_int64(seed + i) for i in range(n)]
        generators = try_request_row(params, self.device, seeds)
        members = [Request.new(member_id, prompt_token_ids, params, prompt, member_seed, generator)
                   for member_id, member_seed, generator in zip(ids, seeds, generators)]
        self.requests.update((m.request_id, m) for m in members)
        leader = members[0]
        self.waiting.append(leader)  # its followers come in with it (`_admit`)
        if n == 1:
            return leader
        group = self.groups[request_id] = RequestGroup(request_id, members)
        leader.followers = members[1:]
        for i, member in enumerate(members):
            member.group, member.index = group, i
            member.leader = leader if i else None
        return group

    @property
    def limits(self) -> RequestLimits:
        return RequestLimits(self.config.max_model_len, self.model.config.vocab_size, self.config.max_num_seqs)

    def abort_request(self, request_id: str) -> None:
        """Aborts a request; the id of a group, or of any of its samples, aborts every sample in it."""
        group = self.groups.get(request_id)
        request = self.requests.get(request_id)
        if group is None and request is not None:
            group = request.group
        for member in group.members if group is not None else [request] if request is not None else []:
            if member.status is Status.FINISHED:
                continue
            if member.status is Status.WAITING and member in self.waiting:
                self.waiting.remove(member)
            member.finish("abort")
            self._retire(member)  # its final text (and its incremental decoder dropped), its slot freed

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------------------------------ the step
    def step(self) -> list[OutputDelta]:
        """Advances every running request by one forward; returns what each request that moved gained."""
        self._admit()
        moved: list[Request] = []
        # in slot order: rows holding consecutive slots read the KV cache as one slice; out of order, every
        # layer of every forward would gather (copy) each row's keys and values first
        decoding = sorted((r for r in self.running if not r.prefilling), key=lambda r: r.slot)
        prefilling = [r for r in self.running if r.prefilling and r.leader is None]  # followers share theirs
        if prefilling:
            started = self.clock()
            moved += self._phase("prefill", prefilling, self._prefill)
            self.stats["prefill_s"] += self.clock() - started
        if decoding:
            moved += self._phase("decode", decoding, self._decode)
        retiring = moved + self.faults.take()
        while retiring:  # retiring may fail a request's text, and with it the request's other samples
            for request in retiring:
                if request.status is Status.FINISHED:
                    self._retire(request)
            retiring = self.faults.take()
            moved += retiring
        outputs = {}  # one per request or group, however many of its samples moved
        for request in moved:
            if request.output_id not in outputs:
                outputs[request.output_id] = request.report()
        broken = self.faults.engine_broken
        if broken is not None:
            self.faults.consecutive.clear()  # the engine's owner decides; the count starts again after
            raise EngineFault(f"{broken} failed {MAX_CONSECUTIVE_FAULTS} steps in a row, whatever requests it held")
        return list(outputs.values())

    def _admit(self) -> None:
        """Gives waiting requests slots, first come first served; a request's n samples all at once."""
        while self.waiting and len(self.free_slots) > len(self.waiting[0].followers):
            leader = self.waiting.popleft()
            for request in (leader, *leader.followers):
                request.slot = self.free_slots.pop(0)
                if self.proposer is not None:
                    self.policy.admit(request.slot)
                request.status = Status.RUNNING
                self.running.append(request)

    def _release(self, request: Request) -> None:
        if self.proposer is not None:
            self.proposer.release(request)
        self._free_slot(request)

    def _free_slot(self, request: Request) -> None:
        if request in self.running:
            self.running.remove(request)
            self.logits_state.release(request.slot)
            self.free_slots.append(request.slot)
            self.free_slots.sort()  # low slots first keeps decode batches contiguous (slice, not gather)
        self.requests.pop(request.request_id, None)
        if request.group is not None and request.group.finished:
            self.groups.pop(request.group.request_id, None)

    def _prefill(self, candidates: list[Request]) -> list[Request]:
        budget = self.config.max_num_batched_tokens
        rows: list[Request] = []
        chunks: list[int] = []
        for request in candidates:
            remaining = request.prompt_len - request.num_computed
            chunk = min(remaining, budget)
            width = max(chunks + [chunk])
            if rows and (len(rows) + 1) * width > budget:
                break
            rows.append(request)
            chunks.append(chunk)
        width = max(chunks)
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        for i, (request, chunk) in enumerate(zip(rows, chunks)):
            start = request.num_computed
            ids[i, :chunk] = torch.tensor(request.prompt_token_ids[start : start + chunk])
        batch = ForwardBatch.build([r.slot for r in rows], [r.num_computed for r in rows], chunks, self.cache,
                                   self.model.config.sliding_window, self.device, pack=True)
        chunk_t = torch.tensor(chunks, dtype=torch.long)
        # the positions whose features the proposer gets: it keeps each row's newest `observe_window`
        seen_starts, seen_counts, hidden_index = [r.num_computed for r in rows], chunks, None
        window = self.proposer.observe_window if self.feature_layers else None
        if window and width > window:
            skips = [max(chunk - window, 0) for chunk in chunks]
            hidden_index = (torch.tensor(skips)[:, None] + torch.arange(window)).minimum(chunk_t[:, None] - 1)
            seen_starts = [start + skip for start, skip in zip(seen_starts, skips)]
            seen_counts = [chunk - skip for chunk, skip in zip(chunks, skips)]
        # logits of the last position only, unless a row asks for its prompt's logprobs: then every position's
        scored = [i for i, r in enumerate(rows) if r.prompt_logprobs is not None]
        last = chunk_t[:, None] - 1
        logits_index = torch.arange(width)[None, :].minimum(last) if scored else last
        out = self._forward(ids, batch, logits_index, hidden_index)
        self.observe_features(rows, seen_starts, seen_counts, out, prompt=True)
        self._share_prefill(rows, chunks, seen_starts, seen_counts, out)
        out = out.logits
        if scored:
            with torch.inference_mode():
                prompt_logprobs(rows, chunks, out, scored, self._sampling(rows), self.config.logprobs_mode)
            out = out.gather(1, last.to(out.device)[:, :, None].expand(-1, 1, out.shape[-1]))
        for request, chunk in zip(rows, chunks):
            request.num_computed += chunk
            self.stats["num_prompt_tokens"] += chunk
        done = [i for i, r in enumerate(rows) if not r.prefilling]
        if not done:
            return []
        finished, reads = [rows[i] for i in done], list(done)  # reads: the row whose logits each samples from
        for i in done:
            for follower in rows[i].followers:
                follower.leader = None
                if follower.prompt_logprobs is not None:
                    follower.prompt_logprobs = list(rows[i].prompt_logprobs)
                finished.append(follower)
                reads.append(i)
            rows[i].followers = []
        sampling = self._sampling(finished)  # each sample its own generator: n different first tokens
        self.take_tokens(finished, self._sample(out[reads, 0], sampling), out[reads], sampling)
        return finished

    def _share_prefill(self, rows: list[Request], chunks: list[int], seen_starts: list[int],
                       seen_counts: list[int], out) -> None:
        """Hands a prefill chunk to the samples sharing it: the target's keys and values copied into their
        slots, the same features to the proposer, the chunk counted as computed."""
        shared = [(i, follower) for i, r in enumerate(rows) for follower in r.followers]
        if not shared:
            return
        for i, request in enumerate(rows):
            if request.followers:
                start = request.num_computed
                self.cache.copy_positions(request.slot, [f.slot for f in request.followers], start, start + chunks[i])
        followers = [f for _, f in shared]
        self.observe_features(followers, [seen_starts[i] for i, _ in shared], [seen_counts[i] for i, _ in shared],
                               out, index=[i for i, _ in shared], prompt=True)
        for i, follower in shared:
            follower.num_computed += chunks[i]

    def _decode(self, rows: list[Request]) -> list[Request]:
        """One decode step: grammar drafts where a row's grammar forces tokens (`forced_tokens`: free drafts,
        so no drafter runs that step), else a speculative step, else a plain one."""
        started = self.clock()
        sampling = self._sampling(rows)
        forced = self.logits_state.forced_tokens(rows, forced_limits(rows, self.config.max_model_len, self.max_forced))
        if forced is not None:
            forced_step(self, rows, forced, started, sampling)
        elif self.proposer is not None:
            self._speculative_decode(rows, started, sampling)
        else:
            self._plain_decode(rows, started, sampling)
        return rows

    def _plain_decode(self, rows: list[Request], started: float, sampling: SamplingBatch, draft_s: float = 0.0,
                      drafts: DraftBatch | None = None):
        """One forward per row of its last token; `draft_s`, `drafts`: drafting this step did for nothing."""
        ids = torch.tensor([[r.last_token] for r in rows], dtype=torch.long)
        out, forward_at = self.step_forward(ids, rows, [1] * len(rows))
        sample_at = self.clock()
        starts = [r.num_tokens - 1 for r in rows]
        if self.feature_layers and not self.proposer.observe_later(rows, starts, out.hidden_states):
            self.observe_features(rows, starts, [1] * len(rows), out)
        for request in rows:
            request.num_computed += 1
        tokens = self._sample(out.logits[:, -1], sampling)
        sampled_at = self.clock()
        self.take_tokens(rows, tokens, out.logits[:, -1:], sampling)
        self._account(rows, 0, started, draft_s, sample_at - forward_at, sampled_at - sample_at, drafts)

    def _speculative_decode(self, rows: list[Request], started: float, sampling: SamplingBatch) -> None:
        """Draft up to w tokens per row (w chosen by the policy), score [last token, drafts] in one forward,
        keep what verifies (`speculative_step` has the pipeline)."""
        if self.policy.held(tuple(r.slot for r in rows)):
            # the step's hidden states still go to the proposer (by reference, `observe_later`): a head
            # resuming with a context of a few positions drafts almost nothing right
            return self._plain_decode(rows, started, sampling)
        limits = draft_limits(rows, self.spec_config.num_speculative_tokens, self.config.max_model_len)
        drafted = plan_and_propose(self, rows, limits, sampling)
        if drafted.failed:
            return self._decode_without_drafts(rows, started, drafted.draft_s)
        self.policy.record(drafted.planned_limits, drafted.plan.width)
        num_draft = drafted.num_draft(len(rows))  # sizes the forward
        if max(num_draft) == 0:
            slots = [r.slot for r in rows]
            if drafted.offered is not None and max(drafted.offered) > 0:  # the cut dropped every draft
                self.policy.observe(slots, drafted.offered, [0] * len(rows))
            else:
                self.policy.idle(slots)
            return self._plain_decode(rows, started, sampling, drafted.draft_s, drafted.drafts)
        checked = verify_drafts(self, rows, drafted.drafts, num_draft, sampling)
        finish_step(self, rows, num_draft, checked, sampling, drafted.offered)
        self._account(rows, max(num_draft), started, drafted.draft_s, checked.forward_s, checked.verify_s,
                      drafted.drafts, drafted.catch_up, sum(checked.query_lens) / len(rows), sum(checked.counts))

    def _account(self, rows: list[Request], width: int, started: float, draft_s: float, forward_s: float,
                 verify_s: float, drafts: DraftBatch | None = None, catch_up: tuple[int, int] = (0, 0),
                 query_len: float = 1.0, tokens: int = 0) -> None:
        """Books one decode step (`StepLedger.book`); `query_len`: the forward's mean real tokens per row;
        `tokens`: what a speculative step gave."""
        cost = self.policy.cost if self.proposer is not None else None
        self.ledger.book(len(rows), width, self.clock() - started, draft_s, forward_s, verify_s, cost, drafts,
                         catch_up, query_len, tokens)

    def step_forward(self, ids: torch.Tensor, rows: list[Request], q_lens: list[int]):
        """A decode or verify forward of ids [B, W] (row b's first q_lens[b] real) -> (its output, when it
        started: its batch's host build is not forward time)."""
        slots, starts = [r.slot for r in rows], [r.num_tokens - 1 for r in rows]
        if self.steps is not None:
            self.stats["num_forward_passes"] += 1
            forward_at = self.clock()
            return self.steps.forward(ids.to(self.device), slots, starts, q_lens), forward_at
        # packed when rows verify unequal numbers of drafts (ForwardBatch.build decides)
        batch = ForwardBatch.build(slots, starts, q_lens, self.cache, self.model.config.sliding_window, self.device,
                                   pack=max(q_lens) > 1)
        forward_at = self.clock()
        return self._forward(ids, batch, None), forward_at

    def _forward(self, ids: torch.Tensor, batch: ForwardBatch, logits_index: torch.Tensor | None,
                 hidden_index: torch.Tensor | None = None):
        self.stats["num_forward_passes"] += 1
        if logits_index is not None:
            logits_index = logits_index.to(self.device)
        if hidden_index is not None:
            hidden_index = hidden_index.to(self.device)
        with torch.inference_mode():
            return self.model(ids.to(self.device), cache=self.cache, batch=batch, logits_index=logits_index,
                              feature_layers=self.feature_layers, hidden_index=hidden_index)

    def observe_features(self, rows: list[Request], starts: list[int], counts: list[int], out,
                          index: list[int] | None = None, prompt: bool = False) -> None:
        """Hands the proposer the target features of newly verified positions (EAGLE-style heads); `index`:
        the forward's row each of `rows` reads (samples sharing a prefill read their leader's); `prompt`: a
        prefill chunk, which the proposer may keep unfed while the policy holds plain decoding."""
        if not self.feature_layers:
            return
        with torch.inference_mode():
            if (prompt and self.policy.holding(len(self.running))
                    and self.proposer.observe_prompt_later(rows, starts, counts, out.hidden_states, index)):
                return
            features = self.proposer.features(out.hidden_states)
            if index is not None:
                features = features[torch.tensor(index, device=features.device)]
            self.proposer.observe(rows, starts, counts, features)

    def _sampling(self, rows: list[Request]) -> SamplingBatch:
        return SamplingBatch.build([r.params for r in rows], [r.generator for r in rows], self.device,
                                   seeds=[r.seed for r in rows], positions=[r.num_tokens for r in rows],
                                   adjust=self.logits_state.adjust(rows))

    def _sample(self, logits: torch.Tensor, sampling: SamplingBatch) -> list[list[int]]:
        """logits [B, V] -> each row's new token, as a one-token list, on the host (the stop checks need it)."""
        with torch.inference_mode():
            return sample(logits, sampling)[:, None].tolist()

    def get_metrics(self) -> dict:
        metrics = {**self.stats, "step_profile": dict(self.ledger.profile), **self.logits_state.metrics()}
        if self.proposer is not None:
            metrics.update(self.spec_metrics.as_dict())
            metrics.update(self.policy.metrics())
            metrics.update(self.proposer.metrics())
        return metrics

    def reset_metrics(self) -> None:
        """Zeroes the speculation counters, the chosen-k histogram and the step profile (benchmarks call it
        after warming up); what the policy has learned is kept."""
        self.ledger.reset_profile()
        self.logits_state.reset_metrics()
        if self.proposer is not None:
            self.spec_metrics.reset()
            self.policy.reset_metrics()
