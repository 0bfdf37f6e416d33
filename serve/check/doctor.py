"""The doctor: re-reads a head under each convention a trainer, converter or engine can slip on, measures each
reading as the gate does, and names the one that accepts clearly more, with the config.json key that
selects it. Most readings change only config keys, so each is a config beside a link to the head's weights;
a reading of a tensor's convention (EAGLE-3's d2t as absolute ids) writes the tensor it reads, and names the
rewrite that fixes the file."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from draftsmith.acceptance_record import Acceptance
from draftsmith.errors import DraftsmithError
from draftsmith.methods import read_head_config
from draftsmith.models.config import RopeConfig
from draftsmith.serve.check.gate import FLOOR

# a reading is named when it keeps at least this many times the drafts a step the head keeps as written (and
# this many more), and clears the floor. Neighbouring layers of a small target are alike: the demo EAGLE-3
# head with its fused layer ids one too high still keeps 1.32 drafts a step of its 2.07
CLEARLY_MORE = 1.25
CLEARLY_MORE_DRAFTS = 0.1
# boolean config keys a slip flips, with what each value means. The norm flags (EAGLE-3 variants) change no
# tensor; the LM-head ones change which tensors the head loads, so only the reading that fits the file loads
FLAGS = {"norm_before_residual": ("norm_before_residual on", "norm_before_residual off"),
         "norm_output": ("norm_output on", "norm_output off"),
         "own_lm_heads": ("LM heads of its own (own_lm_heads)", "the target's LM head (own_lm_heads false)"),
         "tie_weights": ("its stages' weights tied (tie_weights)", "weights of its own per stage (tie_weights false)")}


@dataclass(frozen=True)
class Reading:
    what: str  # the convention, in words
    changes: dict  # config.json keys -> this reading's values
    # the head's tensors -> this reading's (None: the same), and what fixes the file then, in words
    tensors: Callable[[dict], dict] | None = None
    fix: str = ""

    def selector(self) -> str:
        return ", ".join(f'"{key}": {json.dumps(value)}' for key, value in self.changes.items())

    def remedy(self) -> str:
        return self.fix or f"set {self.selector()} in its config.json"


def _d2t_as_offsets(tensors: dict) -> dict:
    d2t = tensors["d2t"]
    return {**tensors, "d2t": d2t - torch.arange(len(d2t), dtype=d2t.dtype)}


D2T_ABSOLUTE = Reading("d2t as absolute target ids (d2t[i] the target id of draft id i, not an offset)", {},
                       _d2t_as_offsets, "rewrite its d2t as offsets, d2t[i] - i (EAGLE-3's convention, which vLLM "
                       "and SGLang read too)")


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


def readings(config: dict, target_rope: RopeConfig | None = None) -> list[Reading]:
    """The alternative readings of a native head config (and, given the target's rope, the head's rope read
    as the target's, where they differ)."""
    found = _layer_readings(config)
    typed = read_head_config(config)  # its defaults: flags an older config.json leaves out
    for flag, (when_on, when_off) in FLAGS.items():
        value = getattr(typed, flag, None)
        if isinstance(value, bool):
            found.append(Reading(when_off if value else when_on, {flag: not value}))
    anchor_first = getattr(typed, "sample_from_anchor", None)  # a block drafter's layout
    if isinstance(anchor_first, bool):
        other = "1+N block layout (the anchor a bonus token)" if anchor_first else \
            "anchor-first block layout (the anchor's output the first draft, DSpark's)"
        found.append(Reading(f"the {other}", {"sample_from_anchor": not anchor_first}))
    if getattr(typed, "draft_vocab_size", None) not in (None, getattr(typed, "vocab_size", None)):
        found.append(D2T_ABSOLUTE)  # only a file whose d2t reads as ascending target ids loads under it
    rope = getattr(typed, "rope", None)
    if target_rope is not None and isinstance(rope, RopeConfig) and rope != target_rope:
        found.append(Reading("the target's rope settings (theta and scaling)", {"rope": asdict(target_rope)}))
    order = getattr(typed, "concat_order", None)
    if order in ("embedding_first", "hidden_first"):
        other = "hidden_first" if order == "embedding_first" else "embedding_first"
        found.append(Reading(f"the MTP input concatenated {other.replace('_', ' ')}", {"concat_order": other}))
    return found


def _variant(head_dir: Path, config: dict, reading: Reading, where: Path) -> Path:
    where.mkdir()
    (where / "config.json").write_text(json.dumps({**config, **reading.changes}, indent=2))
    for weights in head_dir.glob("*.safetensors"):
        if reading.tensors is None:
            (where / weights.name).symlink_to(weights.resolve())
        else:
            save_file(reading.tensors(load_file(str(weights))), str(where / weights.name))
    return where


def examine(head_dir: Path, config: dict, measure: Callable[[Path], Acceptance],
            target_rope: RopeConfig | None = None) -> list[tuple[Reading, Acceptance]]:
    """Each reading that loads, measured by `measure(variant_dir)`, best first."""
    results = []
    with tempfile.TemporaryDirectory(prefix="draftsmith-doctor-") as tmp:
        for index, reading in enumerate(readings(config, target_rope)):
            try:
                results.append((reading, measure(_variant(head_dir, config, reading, Path(tmp) / str(index)))))
            except DraftsmithError:
                continue  # a reading this head cannot take (a layer the target lacks, a tensor it needs)
    return sorted(results, key=lambda found: -found[1].gain())


def diagnosis(as_written: Acceptance | None, examined: list[tuple[Reading, Acceptance]]) -> str | None:
    """One line naming the reading that accepts clearly more than the head as written (None: it does not
    load), or None."""
    if not examined:
        return None
    reading, best = examined[0]
    written = as_written.gain() if as_written else 0.0
    clearly = best.gain() >= max(CLEARLY_MORE * written, written + CLEARLY_MORE_DRAFTS)
    if not clearly or best.per_position[0] < FLOOR:
        return None
    against = f"{written:.2f} as written" if as_written else "none as written (it does not load)"
    return (f"read with {reading.what}, the head accepts {best.gain():.2f} drafts a step against {against}: "
            f"{reading.remedy()}")
