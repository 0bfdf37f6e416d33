"""How likely a prompt lookup's drafts are to be accepted, learned from what the target went on to write.

A lookup's drafts are accepted far more often after a long match than after a short one. On the house
model's greedy continuations of validation code from repositories that training shares (160 prompts, 25,600
positions with a match, k = 4, n = 2..4), the first draft was accepted 55% of the time where the history's
end had occurred before for 2 tokens at most, 74% for exactly 4 and 97% for 16 or more. A row's recent acceptance, which the policy keeps,
cannot tell these apart: a row moves between copying a block it wrote before and writing new code within a
few tokens.

So each proposal's match length (how many tokens before the proposed continuation equal the history's last
ones, up to AGREE_CAP) picks a bucket, and the chance that draft j is accepted given drafts 0..j-1 were is that
bucket's running rate at position j. The proposer reports the running products as its drafts' confidence
(`DraftBatch.confidence`), and the engine verifies of each row only the drafts that pay for the tokens they add
to the verify forward (`serve.speculation.verify_length.size_chains`).

The rates are learned on line, without the verify's help: the next time a row is looked up, the tokens it
gained since are compared with the drafts proposed for it, up to the first that differs. A draft the engine cut
is still compared, so a bucket that was cut keeps learning. Under sampling a draft matches the sampled token
with the chance rejection sampling accepts it, so the rates hold there too.
"""

from __future__ import annotations

import bisect
import itertools
import operator
from dataclasses import dataclass

# a match of at least AGREE_EDGES[i] tokens (and fewer than AGREE_EDGES[i + 1]) falls in bucket i
AGREE_EDGES = (1, 2, 3, 4, 5, 8, 16)
AGREE_CAP = AGREE_EDGES[-1]
# each bucket's rate starts as PRIOR_WEIGHT trials at PRIOR_RATE: a few steps of a batch outweigh it
PRIOR_RATE, PRIOR_WEIGHT = 0.5, 2.0
# a bucket position's trials past this many halve with its acceptances, so recent text weighs more
HALVE_AT = 2048.0


@dataclass(frozen=True)
class Proposal:
    """A row's drafts as proposed: the history length they follow, their match length's bucket, the tokens."""

    length: int
    bucket: int
    tokens: list[int]


def bucket_of(agreed: int) -> int:
    """The bucket of a match of `agreed` tokens (at least 1)."""
    return bisect.bisect_right(AGREE_EDGES, agreed) - 1


class MatchCalibration:
    """Acceptance rates by match-length bucket and draft position, and the proposals not yet settled."""

    def __init__(self, k: int, max_num_seqs: int):
        self.trials = [[0.0] * k for _ in AGREE_EDGES]
        self.accepted = [[0.0] * k for _ in AGREE_EDGES]
        self.pending: list[Proposal | None] = [None] * max_num_seqs

    def rates(self, bucket: int) -> list[float]:
        """The chance that each draft position is accepted given the ones before it were."""
        return [(acc + PRIOR_RATE * PRIOR_WEIGHT) / (tri + PRIOR_WEIGHT)
                for acc, tri in zip(self.accepted[bucket], self.trials[bucket])]

    def survival(self, agreed: list[int]) -> list[list[float]]:
        """Per row, the chance that its drafts 0..j are all accepted, for each j (0 agreed: no match, 0s)."""
        table = [list(itertools.accumulate(self.rates(b), operator.mul)) for b in range(len(AGREE_EDGES))]
        zeros = [0.0] * len(self.trials[0])
        return [table[bucket_of(a)] if a > 0 else zeros for a in agreed]

    def remember(self, slot: int, length: int, agreed: int, tokens: list[int]) -> None:
        """Keeps slot's proposal (none where nothing matched) to settle once the row has gone on."""
        self.pending[slot] = Proposal(length, bucket_of(agreed), tokens) if agreed > 0 and tokens else None

    def forget(self, slot: int) -> None:
        self.pending[slot] = None

    def settle(self, slot: int, length: int, new_tokens: list[int]) -> None:
        """The row in `slot` wrote `new_tokens` after position `length`: its pending proposal, made at that
        length, counts one trial per draft up to the first that differs from what was written, or up to the
        last token written."""
        proposal, self.pending[slot] = self.pending[slot], None
        if proposal is None or proposal.length != length:
            return
        trials, accepted = self.trials[proposal.bucket], self.accepted[proposal.bucket]
        for j, (draft, written) in enumerate(zip(proposal.tokens, new_tokens)):
            trials[j] += 1.0
            if draft != written:
                break
            accepted[j] += 1.0
        for j, count in enumerate(trials):
            if count > HALVE_AT:
                trials[j], accepted[j] = count / 2, accepted[j] / 2
