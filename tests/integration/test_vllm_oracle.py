"""Every `draftsmith convert --to vllm` export of a shipped demo head, served by vLLM's CPU build (the oracle,
tests/vllm_oracle.py): vLLM's greedy ids equal draftsmith's, and its acceptance per draft position is
draftsmith's within a few points, so that a head which loads also accepts what it should. Layouts vLLM
cannot serve must be refused by vLLM and say so at export. Skipped where vLLM's venv is not built (`make
test` builds it, test-only; it skips where vLLM does not install)."""

import json
import shutil
import tempfile
from pathlib import Path

import pytest

import public_checkpoints as pub
import vllm_oracle as oracle
from helpers import DEMO_MODEL

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not oracle.INSTALLED.is_file(),
                                 reason=f"{oracle.INSTALLED} not found: `make peer-vllm` builds vLLM's CPU build there")]
MEAN_TOLERANCE = 0.04  # relative, of the mean acceptance length
POSITION_TOLERANCE = 0.05  # absolute, of each position's acceptance rate


@pytest.mark.parametrize("name", ["eagle", "eagle3", "dflash", "medusa", "pard", "draft_model", "peagle",
                                  "peagle-2-layers", "peagle-window", "dflash-window", "eagle-window"])
def test_vllm_accepts_each_export_as_draftsmith_does(name):
    ours, theirs = oracle.compare(name, oracle.PEER_PYTHON)
    assert theirs.refused is None, theirs.refused
    assert theirs.outputs == ours.outputs  # both greedy: each engine's ids are its plain decoding's
    assert len(theirs.per_position) == len(ours.per_position) == oracle.HEADS[name]["num_speculative_tokens"]
    row = oracle.table_row(name, ours, theirs)
    assert theirs.mean == pytest.approx(ours.mean, rel=MEAN_TOLERANCE), row
    assert theirs.per_position == pytest.approx(ours.per_position, abs=POSITION_TOLERANCE), row
    assert ours.per_position[0] > 0.15, row  # a head that accepts: a slip would fall far below this


def _mlp_speculator(directory: Path) -> dict:
    native = directory / "native"
    assert pub.convert(pub.mlp_speculator(directory / "src"), native, "--target", DEMO_MODEL) == 0
    return {"method": "mlp_speculator", "model": str(native), "num_speculative_tokens": 3}


def _anchor_first_dflash(directory: Path) -> dict:
    """The shipped DFlash head's tensors under DSpark's anchor-first block layout (`sample_from_anchor`)."""
    head = directory / "dflash"
    shutil.copytree(oracle.REPO / oracle.HEADS["dflash"]["model"], head)
    config = json.loads((head / "config.json").read_text())
    (head / "config.json").write_text(json.dumps({**config, "sample_from_anchor": True}))
    return {**oracle.HEADS["dflash"], "model": str(head)}


@pytest.mark.parametrize("name", ["mtp", "mlp_speculator", "dspark"])
def test_an_export_vllm_cannot_serve_says_so(name, tmp_path):
    """DSpark: vLLM 0.32's CPU build runs Model Runner V1, which refuses the method (its V2 runner, which has
    DSpark, needs Triton's CPU backend), so its export is checked here for the refusal and the note only."""
    spec = _mlp_speculator(tmp_path) if name == "mlp_speculator" else oracle.HEADS[name]
    oracle.built_heads()
    with tempfile.TemporaryDirectory() as workdir:
        theirs = oracle.vllm_acceptance(name, spec, oracle.prompts()[:1], oracle.PEER_PYTHON, Path(workdir))
    assert theirs.refused, f"vLLM now serves the {name} export: drop its 'cannot serve' note and compare it"
    assert any(note.startswith("vLLM cannot serve this export") for note in theirs.export_notes), theirs.export_notes


def test_vllm_reads_every_dflash_block_as_1_plus_n_so_an_anchor_first_export_says_so(tmp_path):
    """vLLM's CPU build serves a head marked anchor-first (`dflash_config.sample_from_anchor`) as 1+N without a
    word: the shipped 1+N head's tensors so marked accept in vLLM what draftsmith's 1+N reading accepts. A head
    trained anchor-first would be read one position off there, so its export must say vLLM cannot serve it."""
    spec, prompt = _anchor_first_dflash(tmp_path), oracle.prompts()[:1]
    with tempfile.TemporaryDirectory() as workdir:
        theirs = oracle.vllm_acceptance("dflash_anchor_first", spec, prompt, oracle.PEER_PYTHON, Path(workdir))
    ours = oracle.draftsmith_acceptance(oracle.HEADS["dflash"], prompt)
    assert theirs.refused is None, f"vLLM now refuses the key ({theirs.refused}): say so in the export note"
    assert theirs.per_position == pytest.approx(ours.per_position, abs=POSITION_TOLERANCE), \
        "vLLM now honours sample_from_anchor: compare anchor-first exports instead of refusing them"
    assert any(note.startswith("vLLM cannot serve this export: the head drafts anchor-first")
               for note in theirs.export_notes), theirs.export_notes
