"""Training on a tiny random target: loss falls, online == offline, exact resume after a kill, DDP on CPU."""

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from draftsmith.acceptance_record import read_record
from draftsmith.corpus import load_records
from draftsmith.methods import load_head, resolve_method
from draftsmith.models import load_target
from draftsmith.models.tokenizer import load_tokenizer
from draftsmith.train.capture import CapturedDataset, TargetFeatures, capture
from draftsmith.train.data import collate, tokenize_dataset
from draftsmith.train.recipe import validate_recipe
from draftsmith.train.trainer import HeadWithObjective, build_head, train
from helpers import REPO, make_tiny_target_with_tokenizer, tiny_recipe, write_code_corpus


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    target = make_tiny_target_with_tokenizer(root / "target")
    data = write_code_corpus(root / "code.jsonl")
    return root, target, data


def _log(output, key):
    return [json.loads(line)[key] for line in (output / "train_log.jsonl").read_text().splitlines()]


def _mean(xs):
    return sum(xs) / len(xs)


# the variants speculators trains by default, plus a Qwen3-style layer and a window shorter than the samples
VARIANTS = {"norm_before_residual": True, "norm_before_fc": True, "norm_output": True, "qk_norm": True,
            "sliding_window": 16}


@pytest.mark.parametrize("head_type, variants", [("eagle3", {}), ("eagle", {}), ("eagle3", VARIANTS)])
def test_loss_falls_and_head_is_saved(workspace, head_type, variants):
    root, target, data = workspace
    out = root / f"run-{head_type}-{len(variants)}"
    raw = tiny_recipe(target, data, out, head_type, epochs=3)
    raw["model"].update(variants)
    recipe = validate_recipe(raw)
    final = train(recipe, ["test"])
    losses, agreement = _log(out, "loss"), _log(out, "acc_step0")
    assert len(losses) >= 20
    # A random target's distributions are near uniform, so its entropy dominates the loss; the loss still
    # falls, and top-1 agreement with the target (what acceptance follows) climbs well above chance.
    assert _mean(losses[-5:]) < _mean(losses[:5]), losses
    assert _mean(agreement[-5:]) > _mean(agreement[:5]) + 0.15, agreement
    head = load_head(final)
    assert head.head_type == head_type
    assert all(getattr(head.config, name) == value for name, value in variants.items())
    assert (out / "recipe.yaml").is_file() and (final / "recipe.yaml").is_file()
    checkpoint = sorted((out / "checkpoints").glob("step_*"))[-1]
    assert (checkpoint / "recipe.yaml").is_file() and (checkpoint / "command.txt").is_file()
    report = json.loads((out / "eval_epoch3.json").read_text())
    assert report["sim_mean_acceptance_length_k4"] >= report["sim_mean_acceptance_length_k1"] >= 1.0
    assert report["sim_accept_pos1"] > 0.2  # a regular corpus is learnable in a few dozen steps
    record = read_record(final)  # the newest eval's figures, as the head's record for `draftsmith check`
    assert record.source == "training" and record.k == 4
    assert record.per_position == [report[f"sim_accept_pos{i}"] for i in range(1, 5)]


@pytest.mark.parametrize("storage", ["bfloat16", "fp8"])
def test_online_and_offline_give_the_same_loss(workspace, tmp_path, storage):
    """Online batches round their features through the capture's storage (FP8 with its scales too), so a
    head sees the same values either way."""
    root, target_dir, data = workspace
    recipe = validate_recipe(tiny_recipe(target_dir, data, tmp_path / "o"))
    target = load_target(target_dir)
    tokenizer = load_tokenizer(target_dir)
    tokenized = tokenize_dataset(load_records([str(data)], 8), tokenizer, 64)
    head = build_head(recipe, target, tokenized)
    aux = head.config.aux_layer_ids
    capture(TargetFeatures(target), aux, tokenized, tmp_path / "hs", storage, samples_per_shard=3)
    captured = CapturedDataset(tmp_path / "hs", aux)
    assert captured[0]["features"].dtype == torch.bfloat16
    trainee = HeadWithObjective(head, target, resolve_method("eagle3").objective(), recipe.training, storage)
    shuffled = [5, 0, 7, 2]  # across shards, out of order: as a shuffled epoch reads them
    online = collate([tokenized[i] for i in shuffled])
    offline = collate([captured[i] for i in shuffled])
    assert torch.equal(online["input_ids"], offline["input_ids"]) and torch.equal(online["loss_mask"], offline["loss_mask"])
    computed, stored = trainee.target_outputs(online), trainee.target_outputs(offline)
    for row, length in enumerate(online["lengths"].tolist()):
        for key in ("features", "last"):
            assert torch.equal(computed[key][row, :length], stored[key][row, :length])
    loss_online, _ = trainee(online)
    loss_offline, _ = trainee(offline)
    torch.testing.assert_close(loss_online, loss_offline, atol=1e-5, rtol=1e-5)


def test_offline_training_scores_its_eval_files_online(workspace, tmp_path):
    """Captured features train the head, and `data.eval_files` (code the capture never saw, such as other
    repositories') are what its evals score, their features computed by the target then: none of the
    captured records is held back for eval."""
    from draftsmith.train.trainer import prepare_datasets

    root, target_dir, data = workspace
    held_out = tmp_path / "held_out.jsonl"
    held_out.write_text("".join(line + "\n" for line in data.read_text().splitlines()[:3]))
    raw = tiny_recipe(target_dir, data, tmp_path / "run", epochs=1)
    tokenizer = load_tokenizer(target_dir)
    tokenized = tokenize_dataset(load_records([str(data)]), tokenizer, 64)
    capture(TargetFeatures(load_target(target_dir)), (1, 2, 3), tokenized, tmp_path / "hs", samples_per_shard=8)
    raw["data"].update(hidden_states_dir=str(tmp_path / "hs"), eval_files=[str(held_out)])
    recipe = validate_recipe(raw)
    train_ds, eval_ds = prepare_datasets(recipe, tokenizer, (1, 2, 3))
    assert len(train_ds) == len(tokenized) and len(eval_ds) == 3 and "features" not in eval_ds[0]
    train(recipe, ["test"])
    report = json.loads((tmp_path / "run" / "eval_epoch1.json").read_text())
    assert report["sim_mean_acceptance_length_k1"] >= 1.0


def test_capture_resumes_after_an_interruption(workspace, tmp_path, capsys):
    _, target_dir, data = workspace
    target = load_target(target_dir)
    tokenized = tokenize_dataset(load_records([str(data)], 10), load_tokenizer(target_dir), 64)
    out = capture(TargetFeatures(target), (1, 2, 3), tokenized, tmp_path / "hs", samples_per_shard=4)
    assert "MiB" in capsys.readouterr().out  # the disk estimate comes first
    first = load_file(str(out / "shard_00001.safetensors"))
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["shards"] = manifest["shards"][:1]  # as if killed after the first shard
    (out / "manifest.json").write_text(json.dumps(manifest))
    (out / "shard_00001.safetensors").unlink()
    with pytest.raises(Exception, match="incomplete"):
        CapturedDataset(out, (1, 2, 3))
    capture(TargetFeatures(target), (1, 2, 3), tokenized, out, samples_per_shard=4)
    assert "1 shards already done" in capsys.readouterr().out
    again = load_file(str(out / "shard_00001.safetensors"))
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert len(CapturedDataset(out, (1, 2, 3))) == len(tokenized)


def _run_cli(recipe_path, *extra, launcher=None):
    command = launcher or [sys.executable, "-m", "draftsmith.train"]
    return subprocess.Popen([*command, str(recipe_path), *extra], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, cwd=REPO)


def test_kill_and_resume_matches_an_uninterrupted_run(workspace, tmp_path):
    _, target, data = workspace
    common = dict(epochs=3, max_steps=24, save_every_steps=1, keep_checkpoints=3, batch_size=2)
    for name in ("straight", "killed"):
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(tiny_recipe(target, data, tmp_path / name, **common)))
    straight = _run_cli(tmp_path / "straight.yaml")
    assert straight.wait(timeout=600) == 0, straight.stdout.read()
    killed = _run_cli(tmp_path / "killed.yaml")
    deadline = time.monotonic() + 300
    while not (tmp_path / "killed" / "checkpoints" / "step_00000008").exists():
        assert killed.poll() is None and time.monotonic() < deadline, killed.stdout.read()
        time.sleep(0.02)
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    assert not (tmp_path / "killed" / "head").exists()  # it really died mid-run
    resumed = _run_cli(tmp_path / "killed.yaml")
    log = resumed.communicate(timeout=600)[0]
    assert resumed.returncode == 0, log
    assert "resumed from" in log
    a = load_file(str(tmp_path / "straight" / "head" / "model.safetensors"))
    b = load_file(str(tmp_path / "killed" / "head" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


class _RunsCode:
    """Writes `marker` when unpickled: a planted checkpoint file."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('ran')",)


@pytest.fixture(scope="module")
def finished_run(workspace):
    """A two-step run that saved a checkpoint after each step."""
    root, target, data = workspace
    raw = tiny_recipe(target, data, root / "finished", max_steps=2, save_every_steps=1, batch_size=2)
    train(validate_recipe(raw), ["test"])
    return raw


def _copy_of(finished_run, tmp_path):
    """A copy of the finished run and its recipe, to resume; returns the recipe path and newest checkpoint."""
    raw = json.loads(json.dumps(finished_run))
    shutil.copytree(raw["training"]["output_dir"], tmp_path / "run")
    raw["training"]["output_dir"] = str(tmp_path / "run")
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(raw))
    return tmp_path / "recipe.yaml", tmp_path / "run" / "checkpoints" / "step_00000002"


def test_checkpoints_keep_progress_as_json_and_no_pickle_of_it(finished_run):
    checkpoint = Path(finished_run["training"]["output_dir"]) / "checkpoints" / "step_00000002"
    assert json.loads((checkpoint / "progress.json").read_text()) == {"step": 2, "epoch": 0, "batches_in_epoch": 2}
    assert not list(checkpoint.glob("custom_checkpoint*"))


# without the acceptance gate: a two-step head accepts nothing, and these tests are about resuming
DRAFTSMITH_TRAIN = [sys.executable, "-m", "draftsmith", "train", "--no-check"]


@pytest.mark.parametrize("planted", ["custom_checkpoint_0.pkl", "random_states_0.pkl", "optimizer.bin"])
def test_resume_refuses_a_planted_code_pickle_and_runs_none_of_it(finished_run, tmp_path, planted):
    recipe_path, checkpoint = _copy_of(finished_run, tmp_path)
    marker = tmp_path / "MARKER"
    torch.save(_RunsCode(marker), checkpoint / planted)
    resumed = _run_cli(recipe_path, launcher=DRAFTSMITH_TRAIN)
    log = resumed.communicate(timeout=300)[0]
    assert resumed.returncode == 2, log
    errors = [line for line in log.splitlines() if line.startswith("draftsmith train: error: ")]
    assert len(errors) == 1 and "Traceback" not in log, log
    assert f"refusing to resume from {checkpoint / planted}: " in errors[0], log
    assert "nothing from it was run" in errors[0], log
    assert not marker.exists()


def test_a_checkpoint_with_pickled_progress_and_no_json_resumes(finished_run, tmp_path):
    """A checkpoint whose counters accelerate pickled for a registered object (custom_checkpoint_0.pkl)."""
    recipe_path, checkpoint = _copy_of(finished_run, tmp_path)
    (checkpoint / "progress.json").unlink()
    torch.save({"step": 2, "epoch": 0, "batches_in_epoch": 2}, checkpoint / "custom_checkpoint_0.pkl")
    shutil.rmtree(tmp_path / "run" / "head")
    resumed = _run_cli(recipe_path, launcher=DRAFTSMITH_TRAIN)
    log = resumed.communicate(timeout=300)[0]
    assert resumed.returncode == 0, log
    assert f"resumed from {checkpoint} (step 2, epoch 0)" in log
    assert (tmp_path / "run" / "head" / "model.safetensors").is_file()


def test_eval_only_scores_the_newest_checkpoint_and_trains_nothing(finished_run, workspace, tmp_path):
    """`train --eval-only` with an override after the flag (another eval file, another depth): the newest
    checkpoint's simulated acceptance as reeval_step<N>.json; no step, checkpoint, head, epoch eval or
    recipe.yaml is written. A run without a checkpoint is one line of error."""
    recipe_path, checkpoint = _copy_of(finished_run, tmp_path)
    _, _, data = workspace
    held_out = tmp_path / "held_out.jsonl"
    held_out.write_text("".join(line + "\n" for line in data.read_text().splitlines()[:3]))
    run = tmp_path / "run"
    written = [*run.glob("eval_*.json"), run / "head" / "model.safetensors", run / "recipe.yaml"]
    before = {path.name: path.stat().st_mtime_ns for path in written}
    evaluated = _run_cli(recipe_path, "--eval-only", f"data.eval_files=[{held_out}]", "training.eval_max_k=3",
                         launcher=DRAFTSMITH_TRAIN[:-1])
    log = evaluated.communicate(timeout=300)[0]
    assert evaluated.returncode == 0, log
    report = json.loads((run / "reeval_step00000002.json").read_text())
    assert sorted(k for k in report if k.startswith("sim_mean_acceptance_length_k")) == [
        f"sim_mean_acceptance_length_k{k}" for k in (1, 2, 3)]
    assert 1.0 <= report["sim_mean_acceptance_length_k3"] <= 4.0
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_00000001", "step_00000002"]
    assert {path.name: path.stat().st_mtime_ns for path in written} == before  # the run's record untouched
    shutil.rmtree(run / "checkpoints")
    fresh = _run_cli(recipe_path, "--eval-only", launcher=DRAFTSMITH_TRAIN[:-1])
    log = fresh.communicate(timeout=300)[0]
    assert fresh.returncode == 2 and "Traceback" not in log, log
    assert "holds no checkpoint to evaluate" in log


@pytest.mark.skipif(shutil.which("accelerate") is None and not os.path.exists(os.path.join(os.path.dirname(sys.executable), "accelerate")),
                    reason="accelerate CLI not installed")
def test_accelerate_launch_ddp_on_two_cpu_processes(workspace, tmp_path):
    _, target, data = workspace
    recipe = tiny_recipe(target, data, tmp_path / "ddp", max_steps=4, save_every_steps=2)
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe))
    accelerate = os.path.join(os.path.dirname(sys.executable), "accelerate")
    # `accelerate launch --cpu --num_processes 2` starts ONE process unless given an mpirun hostfile; torchrun
    # (the --multi_gpu launcher) with ACCELERATE_USE_CPU starts two that join a gloo group.
    proc = subprocess.Popen([accelerate, "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
                             "--mixed_precision", "no", "--dynamo_backend", "no", "-m", "draftsmith.train",
                             str(tmp_path / "r.yaml")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=REPO, env={**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1"})
    log = proc.communicate(timeout=600)[0]
    assert proc.returncode == 0, log
    checkpoint = tmp_path / "ddp" / "checkpoints" / "step_00000004"
    assert (checkpoint / "random_states_1.pkl").is_file(), log  # rank 1 existed and saved its RNG state
    head = load_head(tmp_path / "ddp" / "head")
    assert head.head_type == "eagle3"
    saved = load_file(str(tmp_path / "ddp" / "head" / "model.safetensors"))
    assert saved.keys() == head.state_dict().keys()
    assert len(_log(tmp_path / "ddp", "loss")) == 4
    assert (tmp_path / "ddp" / "eval_final.json").is_file()


def test_init_from_keeps_the_saved_architecture_and_says_so(workspace, tmp_path):
    """Continuing a saved head, the recipe cannot ask for another shape or variant: it would be ignored silently.
    A window it names is taken (the weights do not depend on it: P-EAGLE heads continue a sequential one), by
    EAGLE-3 and EAGLE-1 heads alike."""
    from draftsmith.errors import DraftsmithError
    from draftsmith.models import DraftHeadConfig

    root, target_dir, data = workspace
    target = load_target(target_dir, dtype="float32")
    config = DraftHeadConfig.for_target("eagle3", target.config, (1, 2, 3), 512, str(target_dir), norm_output=True)
    resolve_method("eagle3").head_module(config).attach_target(target).save_pretrained(tmp_path / "saved")
    raw = tiny_recipe(target_dir, data, tmp_path / "out", "eagle3")
    raw["model"].update(init_from=str(tmp_path / "saved"), norm_output=True, intermediate_size=None)
    assert build_head(validate_recipe(raw), target, None).config.norm_output  # as saved (null: the default): fine
    raw["model"].update(sliding_window=64)
    assert build_head(validate_recipe(raw), target, None).config.sliding_window == 64
    raw["model"].update(norm_output=False)
    with pytest.raises(DraftsmithError, match=r"the recipe sets norm_output: False \(the head has True\), but "
                                              r"model.init_from continues a saved head"):
        build_head(validate_recipe(raw), target, None)
    eagle1 = DraftHeadConfig.for_target("eagle", target.config, (target.config.num_hidden_layers,), None,
                                         str(target_dir))
    saved = resolve_method("eagle").head_module(eagle1).attach_target(target)
    saved.save_pretrained(tmp_path / "eagle1")
    raw = tiny_recipe(target_dir, data, tmp_path / "out1", "eagle")
    raw["model"].update(init_from=str(tmp_path / "eagle1"), intermediate_size=None, sliding_window=32)
    windowed = build_head(validate_recipe(raw), target, None)
    assert windowed.config.sliding_window == 32 and windowed.layers[0].self_attn.window == 32
    assert all(torch.equal(value, saved.state_dict()[name]) for name, value in windowed.state_dict().items())
    raw["model"].update(init_from=None, fc_bias=False)  # a new EAGLE-1 head as vLLM computes it: no fc bias
    fresh = build_head(validate_recipe(raw), target, None)
    assert fresh.fc.bias is None and fresh.config.sliding_window == 32


def test_max_minutes_stops_at_the_first_step_past_the_budget_and_saves(workspace, tmp_path, monkeypatch):
    """A wall-clock budget (a clock moving one second a look, 6 s of budget): the loop stops at the first
    optimizer step past it, mid-epoch, then evaluates and saves the head in bf16 as public heads ship."""
    from itertools import count

    from draftsmith.train import trainer

    _, target, data = workspace
    seconds = count()
    monkeypatch.setattr(trainer, "clock", lambda: float(next(seconds)))
    recipe = validate_recipe(tiny_recipe(target, data, tmp_path / "run", epochs=3, batch_size=2, max_minutes=0.1))
    final = train(recipe, ["test"])
    assert len(_log(tmp_path / "run", "loss")) == 6  # the budget is read at 0, the loop's start at 1, step n at n + 1
    # the schedule ends with the budget, not with the 3 epochs' steps: step n's rate follows the share read
    # after step n - 1, n / 6, and reaches zero with the budget
    rates = _log(tmp_path / "run", "lr")
    peak = recipe.training.learning_rate
    assert rates == pytest.approx([peak * 0.5 * (1 + math.cos(math.pi * n / 6)) for n in range(1, 7)], abs=1e-9)
    assert (tmp_path / "run" / "eval_final.json").is_file()
    saved = load_file(str(final / "model.safetensors"))
    assert {t.dtype for t in saved.values() if t.is_floating_point()} == {torch.bfloat16}
