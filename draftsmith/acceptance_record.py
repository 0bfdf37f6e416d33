"""A head's acceptance record: how often each draft position was accepted when the head was last measured,
kept as `acceptance.json` beside its config.json. Training writes its eval's simulated figures there,
`draftsmith check --record` what it served, and `convert` carries the file along, so that a served head can be
held to what it did before (`draftsmith check`)."""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

from draftsmith.errors import DraftsmithError

RECORD_FILE = "acceptance.json"
SOURCES = ("check", "training")  # served greedy on calibration prompts; simulated on the training eval split


@dataclass
class Acceptance:
    """Greedy acceptance at a fixed k: mean acceptance length and the rate each position was accepted at."""

    k: int
    mean_acceptance_length: float
    per_position: list[float]
    source: str = "check"
    measured_on: str = ""

    def gain(self, k: int | None = None) -> float:
        """Expected accepted drafts a step, over the first `k` positions (all by default)."""
        return sum(self.per_position[: k or self.k])

    def to_json(self) -> dict:
        return asdict(self)


def read_record(head_dir: Path) -> Acceptance | None:
    path = Path(head_dir) / RECORD_FILE
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        record = Acceptance(int(data["k"]), float(data["mean_acceptance_length"]),
                            [float(r) for r in data["per_position"]], str(data.get("source", "check")),
                            str(data.get("measured_on", "")))
    except (ValueError, KeyError, TypeError) as exc:
        raise DraftsmithError(f"{path}: not an acceptance record ({exc})") from None
    if record.source not in SOURCES or len(record.per_position) != record.k:
        raise DraftsmithError(f"{path}: not an acceptance record (source {record.source!r}, "
                              f"{len(record.per_position)} positions for k={record.k})")
    return record


def write_record(head_dir: Path, record: Acceptance) -> Path:
    path = Path(head_dir) / RECORD_FILE
    path.write_text(json.dumps(record.to_json(), indent=2) + "\n")
    return path


def carry_record(source_dir: Path, out_dir: Path) -> bool:
    """Copies the record of a head in `source_dir`, where it has one, to its conversion in `out_dir`."""
    path = Path(source_dir) / RECORD_FILE
    if not path.is_file():
        return False
    shutil.copyfile(path, Path(out_dir) / RECORD_FILE)
    return True


def training_record(report: dict[str, float], measured_on: str) -> Acceptance | None:
    """The record of a training eval report (`sim_accept_pos{i}` rates, `sim_mean_acceptance_length_k{k}`)."""
    rates = []
    while f"sim_accept_pos{len(rates) + 1}" in report:
        rates.append(float(report[f"sim_accept_pos{len(rates) + 1}"]))
    if not rates:
        return None
    return Acceptance(len(rates), 1 + sum(rates), rates, "training", measured_on)
