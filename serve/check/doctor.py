"""The doctor: re-reads a head under each convention a trainer, converter or engine can slip on, measures each
reading as the gate does, and names the one that accepts clearly more, with the config.json key that
selects it. Readings change only config keys (the tensors are the same), so each is a config beside a link to
the head's weights."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from draftsmith.acceptance_record import Acceptance
from draftsmith.errors import DraftsmithError
from draftsmith.methods import read_head_config
from draftsmith.serve.check.gate import FLOOR

# a reading is named when it keeps at least this many times the drafts a step the head keeps as written (and
# this many more), and clears the floor. Neighbouring layers of a small target are alike: the demo EAGLE-3
# head with its fused layer ids one too high still keeps 1.32 drafts a step of its 2.07
CLEARLY_MORE = 1.25
CLEARLY_MORE_DRAFTS = 0.1
NORM_FLAGS = ("norm_before_residual", "norm_output")  # EAGLE-3 variant flags that change no tensor


@dataclass(frozen=True)
class Reading:
    what: str  # the convention, in words
    changes: dict  # config.json keys -> this reading's values

    def selector(self) -> str:
        return ", ".join(f'"{key}": {json.dumps(value)}' for key, value in self.changes.items())


def _layer_readings(config: dict) -> list[Reading]:
    ids, layers = list(config.get("aux_layer_ids") or []), config.get("target_num_layers")
    if not ids:
        return []
    found = []
    if min(ids) >= 1:
        found.append(Reading("fused layer ids one lower (decoder-layer outputs counted from 0, as z-lab and "
                             "SpecForge name them; draftsmith's are HF hidden_states indices)", {"aux_layer_ids": [i - 1 for i in ids]}))
    if isinstance(layers, int) and max(ids) < layers:
        found.append(Reading("fused layer ids one higher (ids counted from 0 read as hidden_states indices)",
                             {"aux_layer_ids": [i + 1 for i in ids]}))
    for order in (sorted(ids), sorted(ids, reverse=True)):
        if order != ids:
            found.append(Reading("the fused layers in another order", {"aux_layer_ids": order}))
    return found


def readings(config: dict) -> list[Reading]:
    """The alternative readings of a native head config."""
    found = _layer_readings(config)
    typed = read_head_config(config)  # its defaults: flags an older config.json leaves out
    for flag in NORM_FLAGS:
        value = getattr(typed, flag, None)
        if isinstance(value, bool):
            found.append(Reading(f"{flag} {'off' if value else 'on'}", {flag: not value}))
    order = getattr(typed, "concat_order", None)
    if order in ("embedding_first", "hidden_first"):
        other = "hidden_first" if order == "embedding_first" else "embedding_first"
        found.append(Reading(f"the MTP input concatenated {other.replace('_', ' ')}", {"concat_order": other}))
    return found


def _variant(head_dir: Path, config: dict, reading: Reading, where: Path) -> Path:
    where.mkdir()
    (where / "config.json").write_text(json.dumps({**config, **reading.changes}, indent=2))
    for weights in head_dir.glob("*.safetensors"):
        (where / weights.name).symlink_to(weights.resolve())
    return where


def examine(head_dir: Path, config: dict, measure: Callable[[Path], Acceptance]) -> list[tuple[Reading, Acceptance]]:
    """Each reading that loads, measured by `measure(variant_dir)`, best first."""
    results = []
    with tempfile.TemporaryDirectory(prefix="draftsmith-doctor-") as tmp:
        for index, reading in enumerate(readings(config)):
            try:
                results.append((reading, measure(_variant(head_dir, config, reading, Path(tmp) / str(index)))))
            except DraftsmithError:
                continue  # a reading this head cannot take (a layer the target lacks, a tensor it needs)
    return sorted(results, key=lambda found: -found[1].gain())


def diagnosis(as_written: Acceptance, examined: list[tuple[Reading, Acceptance]]) -> str | None:
    """One line naming the reading that accepts clearly more than the head as written, or None."""
    if not examined:
        return None
    reading, best = examined[0]
    clearly = best.gain() >= max(CLEARLY_MORE * as_written.gain(), as_written.gain() + CLEARLY_MORE_DRAFTS)
    if not clearly or best.per_position[0] < FLOOR:
        return None
    return (f"read with {reading.what}, the head accepts {best.gain():.2f} drafts a step against "
            f"{as_written.gain():.2f} as written: set {reading.selector()} in its config.json")
