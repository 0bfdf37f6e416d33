"""`draftsmith check`: the acceptance gate and doctor. Synthetic figures test the rules; the shipped demo heads
must pass their own records, and checkpoints slipped from them (fused layer ids shifted or reordered, a norm
flag flipped, an MTP input concatenated the other way, a DFlash block layout swapped, an LM head the config
claims and the file lacks) must fail with the diagnosis that names the reading they were trained with."""

import json
import os
import shutil
import subprocess
import sys
from dataclasses import asdict

import pytest
import torch
import yaml

import public_checkpoints as pub
from draftsmith.acceptance_record import Acceptance, read_record, training_record, write_record
from draftsmith.cli import main
from draftsmith.errors import DraftsmithError
from draftsmith.models.config import RopeConfig
from draftsmith.serve.apps.demo import wait_healthy
from draftsmith.serve.check import doctor
from draftsmith.serve.check.gate import FLOOR, judge
from draftsmith.serve.openai.cli import free_port
from helpers import DEMO_MODEL, tiny_recipe, write_code_corpus

ASSETS = DEMO_MODEL.parent


def _acceptance(*rates, source="check"):
    return Acceptance(len(rates), 1 + sum(rates), list(rates), source)


def test_a_record_round_trips_and_a_broken_one_is_one_line(tmp_path):
    record = _acceptance(0.7, 0.4, source="training")
    write_record(tmp_path, record)
    assert read_record(tmp_path) == record
    (tmp_path / "acceptance.json").write_text(json.dumps({"k": 3, "mean_acceptance_length": 2, "per_position": [1]}))
    with pytest.raises(DraftsmithError, match="not an acceptance record"):
        read_record(tmp_path)
    assert read_record(tmp_path / "none") is None


def test_a_training_record_reads_the_eval_report():
    report = {"sim_accept_pos1": 0.6, "sim_accept_pos2": 0.3, "sim_mean_acceptance_length_k2": 1.9, "loss": 2.0}
    record = training_record(report, "eval")
    assert (record.k, record.per_position, record.source) == (2, [0.6, 0.3], "training")
    assert record.mean_acceptance_length == pytest.approx(1.9)
    assert training_record({"loss": 1.0}, "eval") is None


def test_the_gate_holds_a_head_to_its_record_or_the_floor():
    check_record = _acceptance(0.8, 0.5, 0.3)  # gain 1.6
    assert judge(_acceptance(0.75, 0.45, 0.2), check_record) is None  # 1.4: 88% of it
    assert "below 80%" in judge(_acceptance(0.6, 0.4, 0.2), check_record)  # 1.2: 75%
    # a training record was simulated on other text: half of it passes
    assert judge(_acceptance(0.6, 0.4, 0.2), _acceptance(0.8, 0.5, 0.3, source="training")) is None
    # compared over the positions both have
    assert judge(_acceptance(0.8, 0.5), check_record) is None
    assert judge(_acceptance(FLOOR + 0.01, 0.0), None) is None
    assert "below the floor" in judge(_acceptance(FLOOR - 0.01, 0.3), None)


def test_the_doctor_names_a_reading_only_when_it_accepts_clearly_more():
    as_written = _acceptance(0.3, 0.1)
    shifted = doctor.Reading("layer ids one lower", {"aux_layer_ids": [0, 2, 4]})
    line = doctor.diagnosis(as_written, [(shifted, _acceptance(0.6, 0.3))])
    assert line.startswith("read with layer ids one lower") and '"aux_layer_ids": [0, 2, 4]' in line
    assert doctor.diagnosis(as_written, [(shifted, _acceptance(0.32, 0.15))]) is None  # 1.18x: not clearly
    assert doctor.diagnosis(_acceptance(0.0, 0.0), [(shifted, _acceptance(0.05, 0.0))]) is None  # below the floor
    assert doctor.diagnosis(as_written, []) is None


def test_a_passing_line_names_a_reading_that_accepts_more_though_not_clearly():
    from draftsmith.serve.check.cli import verdict

    result = {"failed": None, "record": None, "acceptance": _acceptance(0.6, 0.4, 0.3, 0.2, 0.3).to_json(),
              "readings": [{"reading": "the target's rope settings", "drafts_per_step": 2.09}]}
    assert verdict(result) == ("passed (the floor, no record); read with the target's rope settings it accepts 2.09 "
                               "drafts a step against 1.80, short of clearly more")
    result["readings"][0]["drafts_per_step"] = 1.85
    assert verdict(result) == "passed (the floor, no record)"


def test_readings_cover_layer_ids_flags_block_layout_and_concatenation_order():
    def changes(head):
        return [r.changes for r in doctor.readings(json.loads((ASSETS / f"demo-code-7m-{head}" / "config.json").read_text()))]

    eagle3 = changes("eagle3")
    assert doctor.D2T_ABSOLUTE in doctor.readings(json.loads((ASSETS / "demo-code-7m-eagle3" / "config.json").read_text()))
    assert {"aux_layer_ids": [0, 2, 4]} in eagle3 and {"aux_layer_ids": [2, 4, 6]} in eagle3
    assert {"aux_layer_ids": [5, 3, 1]} in eagle3 and {"norm_before_residual": True} in eagle3
    assert changes("mtp") == [{"concat_order": "embedding_first"}]
    assert {"sample_from_anchor": True} in changes("dflash")
    assert changes("medusa") == [{"own_lm_heads": True}]
    config = json.loads((ASSETS / "demo-code-7m-eagle3" / "config.json").read_text())
    target_rope = RopeConfig(theta=500000.0)  # a head whose converter kept a default theta: read as the target's
    assert {"rope": asdict(target_rope)} in [r.changes for r in doctor.readings(config, target_rope)]
    assert not any("rope" in r.changes for r in doctor.readings(config, RopeConfig(**config["rope"])))


@pytest.mark.slow
@pytest.mark.parametrize("head", ["eagle", "eagle3", "dflash", "medusa", "mtp"])
def test_the_shipped_heads_pass_their_own_records(head, capsys):
    assert read_record(ASSETS / f"demo-code-7m-{head}") is not None
    assert main(["check", str(ASSETS / f"demo-code-7m-{head}")]) == 0
    assert "passed (against its record)" in capsys.readouterr().out


def _slipped(tmp_path, head: str, changes: dict):
    slipped = tmp_path / head
    shutil.copytree(ASSETS / f"demo-code-7m-{head}", slipped)
    (slipped / "acceptance.json").unlink()  # a slip made in conversion: the record is the converter's to carry
    config = json.loads((slipped / "config.json").read_text())
    (slipped / "config.json").write_text(json.dumps({**config, **changes, "target_model": str(DEMO_MODEL)}))
    return slipped


@pytest.mark.slow
@pytest.mark.parametrize("head, slip, right", [
    ("eagle3", {"aux_layer_ids": [2, 4, 6]}, '"aux_layer_ids": [1, 3, 5]'),
    ("eagle3", {"aux_layer_ids": [5, 3, 1]}, '"aux_layer_ids": [1, 3, 5]'),
    ("eagle3", {"norm_before_residual": True}, '"norm_before_residual": false'),
    ("dflash", {"aux_layer_ids": [0, 1, 2, 3, 4, 5]}, '"aux_layer_ids": [1, 2, 3, 4, 5, 6]'),
    ("mtp", {"concat_order": "embedding_first"}, '"concat_order": "hidden_first"'),
    ("dflash", {"sample_from_anchor": True}, '"sample_from_anchor": false'),
])
def test_a_slipped_head_fails_with_the_reading_that_fixes_it(head, slip, right, tmp_path, capsys):
    assert main(["check", str(_slipped(tmp_path, head, slip)), "--json"]) == 1
    captured = capsys.readouterr()
    verdict = captured.err.strip().splitlines()[-1]
    assert verdict.startswith("draftsmith check: FAILED:") and f"set {right} in its config.json" in verdict
    result = json.loads(captured.out)
    assert result["failed"] and right in result["diagnosis"] and len(result["acceptance"]["per_position"]) == 5


@pytest.mark.slow
def test_a_head_missing_the_lm_heads_its_config_claims_is_read_with_the_targets(tmp_path, capsys):
    """A Medusa config saying own_lm_heads over a file without them (vLLM's `original_lm_head` export defect,
    the other way round) does not load as written; the doctor finds the reading that loads and accepts."""
    assert main(["check", str(_slipped(tmp_path, "medusa", {"own_lm_heads": True})), "--json"]) == 1
    captured = capsys.readouterr()
    verdict = captured.err.strip().splitlines()[-1]
    assert "does not load as written" in verdict and "missing ['lm_heads.0.weight'" in verdict
    assert 'against none as written (it does not load): set "own_lm_heads": false in its config.json' in verdict
    assert json.loads(captured.out)["acceptance"] is None


@pytest.mark.slow
def test_a_d2t_of_absolute_ids_is_named_and_the_rewrite_that_fixes_it(tmp_path, capsys):
    """EAGLE-3's d2t holds offsets; a converter that wrote absolute target ids leaves a head that maps drafts
    past the vocabulary. It does not load (one line saying so), and the doctor's tensor reading finds it."""
    from safetensors.torch import load_file, save_file

    slipped = _slipped(tmp_path, "eagle3", {})
    tensors = load_file(str(slipped / "model.safetensors"))
    tensors["d2t"] = tensors["d2t"] + torch.arange(len(tensors["d2t"]))
    save_file(tensors, str(slipped / "model.safetensors"))
    assert main(["check", str(slipped)]) == 1
    verdict = capsys.readouterr().out.strip().splitlines()[-1]
    assert "its values look like absolute target ids, where d2t holds offsets" in verdict
    assert "read with d2t as absolute target ids" in verdict and "rewrite its d2t as offsets, d2t[i] - i" in verdict


@pytest.mark.slow
def test_a_draft_model_and_a_pard_draft_are_checked_as_draft_model_serves_them(capsys):
    """Whole LMs as drafts (what `draftsmith train` saves for PARD, which its gate checks): measured with the
    draft_model method, in parallel where the config names a PARD mask token, against the floor; no doctor."""
    for draft, parallel in ((DEMO_MODEL, False), (ASSETS / "demo-code-7m-pard", True)):
        assert main(["check", str(draft), "--target", str(DEMO_MODEL), "--json"]) == 0
        result = json.loads(capsys.readouterr().out)
        assert (result["head_type"], result["k"], result["readings"], result["failed"]) == ("draft_model", 5, [], None)
        first = result["acceptance"]["per_position"][0]
        assert first == 1.0 if not parallel else 0.3 < first < 1.0  # the target drafting for itself: all of it


@pytest.mark.slow
def test_serve_refuses_a_slipped_head_before_it_listens(tmp_path, capsys):
    slipped = _slipped(tmp_path, "mtp", {"concat_order": "embedding_first"})
    spec = json.dumps({"method": "mtp", "model": str(slipped), "num_speculative_tokens": 2})
    assert main(["serve", str(DEMO_MODEL), "--port", str(free_port()), "--device", "cpu",
                 "--speculative-config", spec]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("draftsmith serve: error: acceptance gate FAILED") and "--no-check" in err
    assert 'set "concat_order": "hidden_first"' in err


@pytest.mark.slow
def test_serve_checks_a_head_at_start_and_then_serves(tmp_path):
    port, log = free_port(), tmp_path / "serve.log"
    spec = json.dumps({"method": "eagle3", "model": str(ASSETS / "demo-code-7m-eagle3"), "num_speculative_tokens": 3})
    with log.open("w") as out:
        process = subprocess.Popen([sys.executable, "-m", "draftsmith", "serve", str(DEMO_MODEL), "--port", str(port),
                                    "--device", "cpu", "--max-model-len", "512", "--speculative-config", spec],
                                   stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        wait_healthy(f"http://127.0.0.1:{port}", process, log, timeout=180)
        assert "acceptance gate passed (against its record): eagle3 accepts" in log.read_text()
    finally:
        process.terminate()
        process.wait(timeout=60)


@pytest.mark.slow
def test_convert_with_a_target_gates_what_it_wrote(tmp_path, capsys):
    slipped = _slipped(tmp_path, "mtp", {"concat_order": "embedding_first"})
    assert pub.convert(slipped, tmp_path / "vllm", "--to", "vllm", "--target", DEMO_MODEL, check=True) == 1
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("draftsmith convert: acceptance gate FAILED") and '"concat_order": "hidden_first"' in line
    assert (tmp_path / "vllm" / "config.json").is_file()  # written: the gate judges it, it does not hide it
    assert pub.convert(ASSETS / "demo-code-7m-medusa", tmp_path / "medusa", "--target", DEMO_MODEL, check=True) == 0
    assert "draftsmith convert: acceptance gate passed (against its record)" in capsys.readouterr().out


@pytest.mark.slow
def test_train_gates_the_head_it_saved(tmp_path, monkeypatch, capsys):
    """The trainer is replaced by one that 'saves' a slipped head: the wiring is what is tested here."""
    import draftsmith.train.trainer as trainer

    slipped = _slipped(tmp_path, "eagle3", {"aux_layer_ids": [5, 3, 1]})
    recipe = tiny_recipe(DEMO_MODEL, write_code_corpus(tmp_path / "corpus.jsonl", 8), tmp_path / "run")
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    monkeypatch.setattr(trainer, "train", lambda recipe, argv: slipped)
    assert main(["train", str(tmp_path / "recipe.yaml")]) == 1
    assert '"aux_layer_ids": [1, 3, 5]' in capsys.readouterr().out
    assert main(["train", str(tmp_path / "recipe.yaml"), "--no-check"]) == 0
    # what a PARD recipe saves is a whole LM, which the gate measures as draft_model serves it
    monkeypatch.setattr(trainer, "train", lambda recipe, argv: ASSETS / "demo-code-7m-pard")
    assert main(["train", str(tmp_path / "recipe.yaml")]) == 0
    assert "draftsmith train: acceptance gate passed (the floor, no record)" in capsys.readouterr().out


@pytest.mark.slow
def test_an_export_is_checked_through_its_native_reading_with_its_record(tmp_path, capsys):
    assert pub.convert(ASSETS / "demo-code-7m-medusa", tmp_path / "vllm", "--to", "vllm") == 0
    capsys.readouterr()
    assert main(["check", str(tmp_path / "vllm"), "--target", str(DEMO_MODEL)]) == 0
    assert "draftsmith check: passed (against its record)" in capsys.readouterr().out
