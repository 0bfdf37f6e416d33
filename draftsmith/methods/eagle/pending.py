"""The EAGLE proposer's pending features: each slot's verified positions whose features the head has not yet
run over, kept until the next propose's catch-up reads them.

The buffer is a ring `[max_num_seqs, W, F]` (position p in column p mod W), W at most MAX_PENDING, not
max_model_len wide: a whole prompt of EAGLE-3 features (3 x hidden each) for every slot would cost hundreds
of MB. A row whose pending positions would outgrow W (a prompt, or a long stretch of steps the policy ran
without speculation) keeps the newest W, and the head's context starts at the first of them
(`context_start`; its attention masks keys before it). So a prompt costs the head at most W positions, paid
at the first propose, and nothing at all while speculation stays off (running the head over whole prompts
had made 16 prompts' prefill 0.55 s instead of 0.34); on the demo EAGLE-3 head, W = 64 moved the mean
acceptance length from 3.61 (whole prompt in context) to 3.58.

Plain steps hand their hidden states over by reference (`observe_later`); their features are built and
written only when drafting needs them (`replay`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

import torch

from draftsmith.errors import DraftsmithError
from draftsmith.methods.proposer_base import RowState

# Pending positions kept per slot, at most: the head's context when a row starts or resumes drafting (64 keeps
# acceptance within 1% of the whole prompt on the demo head; 16 loses 8%), few enough that the catch-up over
# them stays one small forward. The buffer also stays within PENDING_BYTES.
MAX_PENDING = 64
PENDING_BYTES = 64 * 2**20


class PendingFeatures:
    """Per slot: the first pending position (-1: slot unused), how many are pending, where the head's context
    starts, all host lists (a decode step updates a handful of ints per row, which tensor ops would turn into
    some twenty dispatches per step); the features themselves in the ring, allocated at the first observe."""

    def __init__(self, max_num_seqs: int, k: int, max_model_len: int, device: torch.device,
                 features: Callable[[dict], torch.Tensor], feature_layers: tuple[int, ...]):
        self.max_num_seqs, self.k, self.max_model_len, self.device = max_num_seqs, k, max_model_len, device
        self.features, self.feature_layers = features, feature_layers
        self.width = 0  # W, set with the ring once the feature width is known
        self.window = max(MAX_PENDING, 2 * (k + 1))  # W is at most this
        self.ring: torch.Tensor | None = None  # [max_num_seqs + 1, W, F] (last row: scratch)
        self.start = [-1] * max_num_seqs
        self.length = [0] * max_num_seqs
        self.context_start = [0] * max_num_seqs
        # plain steps' hidden states not yet observed, newest `window` of them; a slot's generation moves on at
        # release, so that a finished request's steps are not replayed
        self._later: deque = deque(maxlen=self.window)
        self._later_total = 0
        self._generation = [0] * max_num_seqs

    def observe_later(self, rows: Sequence[RowState], starts: list[int], hidden_states) -> bool:
        """Keeps a plain decode step's hidden states (one position per row) by reference and builds their
        features only when drafting needs them: while the policy keeps speculation off, the cat and the
        ring scatter of every step (about 4% of a plain step at 8 rows) are skipped, and steps older than
        the ring's width are never built at all."""
        if self.ring is None:  # the first observe sizes the ring
            return False
        slots = [r.slot for r in rows]
        self._later.append((slots, [self._generation[s] for s in slots], starts, hidden_states))
        self._later_total += 1
        return True

    @torch.inference_mode()
    def replay(self) -> None:
        """Observes the kept plain steps in order; rows released since are skipped. Steps of the same live rows
        at consecutive positions are observed as one: one features build and one scatter (step by step, a
        P-EAGLE resume after 58 held steps took 2.46 ms here, 1.91 ms so). Past the ring's width the oldest were
        dropped, so a row's run may resume after a gap: its context then starts after it, as the ring would
        have kept no more anyway."""
        if not self._later:
            return
        later, gaps = list(self._later), self._later_total > len(self._later)
        self._later.clear()
        self._later_total = 0
        run: list = []  # (live row indices, hidden states) of steps continuing the run's first
        run_slots: list[int] = []
        run_starts: list[int] = []
        for slots, generations, starts, hidden in later:
            live = [i for i, (s, g) in enumerate(zip(slots, generations)) if self._generation[s] == g]
            if not live:
                continue
            live_slots, live_starts = [slots[i] for i in live], [starts[i] for i in live]
            if run and (live_slots != run_slots or live_starts != [s + len(run) for s in run_starts]):
                self._observe_run(run_slots, run_starts, run, gaps)
                run = []
            if not run:
                run_slots, run_starts = live_slots, live_starts
            run.append((live if len(live) < len(slots) else None, hidden))
        if run:
            self._observe_run(run_slots, run_starts, run, gaps)

    def _observe_run(self, slots: list[int], starts: list[int], run: list, gaps: bool) -> None:
        """Kept plain steps of these rows at consecutive positions from `starts`, observed as one."""
        def layer(i: int) -> torch.Tensor:
            parts = [h[i] if live is None else h[i][torch.tensor(live, device=h[i].device)] for live, h in run]
            return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)

        features = self.features({i: layer(i) for i in self.feature_layers})
        self.observe(slots, starts, [len(run)] * len(slots), features, gaps)

    def observe(self, slots: list[int], starts: list[int], counts: list[int], features: torch.Tensor,
                gaps: bool = False) -> None:
        """Row i's features [B, T, F] of positions starts[i] .. starts[i] + counts[i] - 1 join its pending
        ones, which they must continue (or, with `gaps`, follow after a gap)."""
        if self.ring is None:
            # at least 2(k+1), whatever the budget: a context of two verify steps' positions after a pause
            fit = PENDING_BYTES // ((self.max_num_seqs + 1) * features.shape[-1] * features.element_size())
            self.width = min(max(min(fit, MAX_PENDING), 2 * (self.k + 1)), self.max_model_len)
            self.ring = features.new_zeros(self.max_num_seqs + 1, self.width, features.shape[-1])
        width = self.width
        for slot, start, count in zip(slots, starts, counts):
            first, held = self.start[slot], self.length[slot]
            if first < 0 or (gaps and start > first + held):
                first = self.context_start[slot] = start
            elif start != first + held:
                raise DraftsmithError("observed positions must continue each request's earlier ones")
            # Keep the newest W positions; when older ones fall out, the head's context starts at the first
            # kept: what it forgets is far back (a prompt's start, or a long stretch without speculation).
            kept = max(first, start + count - width)
            if kept > first:
                self.context_start[slot] = kept
            self.start[slot], self.length[slot] = kept, start + count - kept
        # One scatter writes each row's newest features into its ring (column = position mod W); columns
        # outside a row's newest W, and its padding, go to the scratch row. Indices listed on the host: a
        # tensor each, not a dozen small ops.
        lo, hi, scratch = max(min(counts) - width, 0), max(counts), self.max_num_seqs
        to_slot = [[slot if n - width <= c < n else scratch for c in range(lo, hi)] for slot, n in zip(slots, counts)]
        to_column = [[(start + c) % width for c in range(lo, hi)] for start in starts]
        self.ring[torch.tensor(to_slot, device=self.device), torch.tensor(to_column, device=self.device)] = \
            features[:, lo:hi]

    def owed(self, slots: list[int]) -> list[int]:
        """Positions each slot's next catch-up runs over, the plain steps kept for later included (without
        replaying: every decoding row is in each plain step kept since the last observe, as a row joins
        decoding right after its prompt's observe, which replays them)."""
        later = len(self._later)
        return [min(self.length[s] + later, self.width) for s in slots]

    def read(self, slots: list[int], first: list[int], width: int) -> torch.Tensor:
        """[len(slots), width, F]: each slot's pending features from position first[i] on, read from its ring
        (one row whose positions do not wrap around the ring: a view)."""
        ring_at = first[0] % self.width
        if len(slots) == 1 and ring_at + width <= self.width:
            return self.ring[slots[0], ring_at : ring_at + width][None]
        columns = [[(begin + i) % self.width for i in range(width)] for begin in first]
        return self.ring[torch.tensor(slots, device=self.device)[:, None], torch.tensor(columns, device=self.device)]

    def consumed(self, slots: list[int]) -> None:
        """The slots' pending positions are in the head's cache now: none pending, the next starts after."""
        for slot in slots:
            self.start[slot], self.length[slot] = self.start[slot] + self.length[slot], 0

    def release(self, slot: int) -> None:
        self._generation[slot] += 1  # its plain steps kept for later are not replayed
        self.start[slot] = -1
        self.length[slot] = 0
