"""What a speculation policy answers for one step (`StepPlan`), and the widths it gave, counted for the metrics
(`WidthCounts`): the values every policy shares, and `int_list`, how they all read slots and limits."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StepPlan:
    width: int  # drafts per row at most this step (0 = plain decode)
    stop_below: float = 0.0  # confidence floor for proposers that stop early
    expected_tokens: float = 0.0
    expected_seconds: float = 0.0
    # run to measure acceptance, not because it pays best (a probe, a draft deeper than pays): verified whole
    explore: bool = False
    # the rows' acceptance rates by draft position that the plan priced (`AcceptanceStats.rates`), by which the
    # engine cuts each row's drafts to those that pay (`verify_length.size_chains_by_rates`); None: no cut
    row_rates: list[list[float]] | None = None

    @property
    def tokens_per_s(self) -> float:
        return self.expected_tokens / self.expected_seconds if self.expected_seconds else 0.0


@dataclass
class WidthCounts:
    """(row, step) pairs by the draft limit the policy gave them, and the steps run without speculation: the
    metrics `spec_k_histogram` and `num_steps_without_speculation`."""

    k: int
    row_widths: list[int] = field(default_factory=list)  # [k + 1]: index w counts rows given w drafts
    plain_steps: int = 0

    def __post_init__(self) -> None:
        self.row_widths = self.row_widths or [0] * (self.k + 1)

    def plain(self, rows: int) -> None:
        """A step of `rows` rows decoded without speculation."""
        self.plain_steps += 1
        self.row_widths[0] += rows

    def record(self, limits, width: int) -> None:
        """A planned step of `width` drafts at most; `limits[b]`: what row b could have drafted."""
        if width == 0:
            self.plain(len(limits))
            return
        for limit in int_list(limits):
            self.row_widths[min(limit, width)] += 1

    def metrics(self) -> dict:
        return {"spec_k_histogram": list(self.row_widths), "num_steps_without_speculation": self.plain_steps}


def int_list(values) -> list[int]:
    """Any int sequence (list, tuple, numpy array, CPU tensor) as a list of Python ints."""
    return values.tolist() if hasattr(values, "tolist") else list(values)
