"""Sharded training on CPU: FSDP2 (recipes/accelerate/fsdp.yaml) on two gloo processes saves the whole head,
evaluates it gathered, matches a DDP run of the same recipe and resumes from its sharded checkpoints.

accelerate 1.15 turns FSDP on only for GPU-like devices (`AcceleratorState.__init__` switches MULTI_GPU,
MULTI_NPU, ... to FSDP, never MULTI_CPU), so the launched workers are this file run as a script: it makes
the MULTI_CPU state FSDP before the trainer builds its `Accelerator`. Everything after that is accelerate's
and torch's real FSDP2 code (fully_shard on a CPU mesh, DTensor gradients, sharded save_state, get_state_dict).
"""

import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from helpers import REPO, make_tiny_target_with_tokenizer, tiny_recipe, write_code_corpus

ACCELERATE = os.path.join(os.path.dirname(sys.executable), "accelerate")
LAUNCH = [ACCELERATE, "launch", "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
          "--dynamo_backend", "no"]
STEPS = 4

pytestmark = pytest.mark.skipif(not os.path.exists(ACCELERATE), reason="accelerate CLI not installed")


def _select_fsdp_on_cpu() -> None:
    """In a launched worker: let the FSDP plugin accelerate built from the launch config take effect on CPU."""
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    init = AcceleratorState.__init__

    def __init__(self, *args, fsdp_plugin=None, **kwargs):
        init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.fsdp_plugin = fsdp_plugin
            # both shared states: a later AcceleratorState() copies PartialState's distributed_type back
            self.distributed_type = PartialState._shared_state["distributed_type"] = DistributedType.FSDP

    AcceleratorState.__init__ = __init__


def _launch(recipe_path: Path, launcher: list[str], succeed: bool = True, **env) -> str:
    """Two processes in a gloo group: torchrun (accelerate's --multi_gpu and FSDP launcher) with
    ACCELERATE_USE_CPU; `accelerate launch --cpu --num_processes 2` would start one process."""
    proc = subprocess.run([*launcher, str(recipe_path)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, cwd=REPO, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO / "tests"), "OMP_NUM_THREADS": "1", **env})
    assert (proc.returncode == 0) == succeed, proc.stdout
    return proc.stdout


def _fsdp(recipe_path: Path, succeed: bool = True) -> str:
    # the FSDP_* settings come from fsdp.yaml (the command line overrides its process count and precision)
    return _launch(recipe_path, [*LAUNCH, "--config_file", str(REPO / "recipes/accelerate/fsdp.yaml"), __file__],
                   succeed, ACCELERATE_USE_CPU="true")


def _write_recipe(path: Path, target, data, output: Path) -> Path:
    # fp32 heads: FSDP and DDP are compared to 2e-5, finer than a bf16 rounding apart
    path.write_text(yaml.safe_dump(tiny_recipe(target, data, output, max_steps=STEPS, save_every_steps=2,
                                               save_dtype="float32")))
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same recipe trained by FSDP and by DDP, both on two CPU processes."""
    root = tmp_path_factory.mktemp("sharded")
    target = make_tiny_target_with_tokenizer(root / "target")
    data = write_code_corpus(root / "code.jsonl")
    log = _fsdp(_write_recipe(root / "fsdp.yaml", target, data, root / "fsdp"))
    _launch(_write_recipe(root / "ddp.yaml", target, data, root / "ddp"),
            [*LAUNCH, "--multi_gpu", "-m", "draftsmith.train"], ACCELERATE_USE_CPU="true")
    return root, log


def test_fsdp_saves_the_gathered_head_and_matches_ddp(runs):
    from draftsmith.methods import load_head

    root, log = runs
    fsdp, ddp = root / "fsdp", root / "ddp"
    # It really was FSDP: the checkpoints are torch.distributed.checkpoint shards, one per rank.
    shards = sorted(p.name for p in (fsdp / "checkpoints" / f"step_{STEPS:08d}" / "pytorch_model_fsdp_0").iterdir())
    assert shards == [".metadata", "__0_0.distcp", "__1_0.distcp"], shards
    assert "training eagle3 head" in log and "saved head to" in log
    head = load_head(fsdp / "head")  # strict: every tensor of its config's full shape
    a, b = load_file(str(fsdp / "head" / "model.safetensors")), load_file(str(ddp / "head" / "model.safetensors"))
    assert a.keys() == b.keys() == head.state_dict().keys()
    for name in a:
        assert a[name].shape == b[name].shape, name
        torch.testing.assert_close(a[name], b[name], atol=2e-5, rtol=1e-4, msg=name)
    # trained weights, not the initialization: the LM head starts as the target's rows of the draft vocab
    target = load_file(str(root / "target" / "model.safetensors"))
    rows = target.get("lm_head.weight", target["model.embed_tokens.weight"])  # tied
    start = rows[torch.arange(len(a["d2t"])) + a["d2t"]]
    assert a["lm_head.weight"].shape == start.shape
    assert not torch.allclose(a["lm_head.weight"], start, atol=1e-4)
    losses = [[json.loads(line)["loss"] for line in (run / "train_log.jsonl").read_text().splitlines()]
              for run in (fsdp, ddp)]
    assert len(losses[0]) == STEPS and losses[0] == pytest.approx(losses[1], rel=1e-4)
    # the eval (stopped mid-epoch by max_steps: "final") ran on gathered parameters: DDP's numbers
    reports = [json.loads((run / "eval_final.json").read_text()) for run in (fsdp, ddp)]
    assert reports[0] == pytest.approx(reports[1], abs=1e-6)
    assert reports[0]["sim_mean_acceptance_length_k1"] >= 1.0


def test_fsdp_resumes_from_its_sharded_checkpoint(runs, tmp_path):
    root, _ = runs
    resumed = tmp_path / "resumed"
    shutil.copytree(root / "fsdp", resumed)
    shutil.rmtree(resumed / "head")
    shutil.rmtree(resumed / "checkpoints" / f"step_{STEPS:08d}")  # as if killed after step 2's checkpoint
    recipe = tiny_recipe(root / "target", root / "code.jsonl", resumed, max_steps=STEPS, save_every_steps=2,
                         save_dtype="float32")
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe))
    log = _fsdp(tmp_path / "r.yaml")
    assert f"resumed from {resumed / 'checkpoints' / 'step_00000002'}" in log
    a = load_file(str(root / "fsdp" / "head" / "model.safetensors"))
    b = load_file(str(resumed / "head" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


class _RunsCode:
    """Writes `marker` when unpickled: a planted checkpoint file."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('ran')",)


def test_fsdp_resume_refuses_a_planted_dcp_index_and_runs_none_of_it(runs, tmp_path):
    """torch's DCP reader would `pickle.load` the index; every rank refuses it first, in one line."""
    root, _ = runs
    resumed = tmp_path / "resumed"
    shutil.copytree(root / "fsdp", resumed)
    planted = resumed / "checkpoints" / f"step_{STEPS:08d}" / "pytorch_model_fsdp_0" / ".metadata"
    marker = tmp_path / "MARKER"
    planted.write_bytes(pickle.dumps(_RunsCode(marker)))
    recipe = tiny_recipe(root / "target", root / "code.jsonl", resumed, max_steps=STEPS, save_every_steps=2,
                         save_dtype="float32")
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe))
    log = _fsdp(tmp_path / "r.yaml", succeed=False)
    errors = [line for line in log.splitlines() if line.startswith("draftsmith train: error: ")]
    assert len(errors) == 2, log  # one line from each rank
    assert all(line.startswith(f"draftsmith train: error: refusing to resume from {planted}: it is a pickle that "
                               "needs code to load") and "nothing from it was run" in line for line in errors), log
    assert not marker.exists()


def test_save_head_refuses_a_shard(tmp_path):
    """What saving the unwrapped module's shards would write is caught before it reaches disk."""
    from draftsmith.methods import resolve_method
    from draftsmith.models import load_target
    from draftsmith.train.recipe import validate_recipe
    from draftsmith.train.trainer import HeadWithObjective, build_head, save_head

    target_dir = make_tiny_target_with_tokenizer(tmp_path / "target")
    recipe = validate_recipe(tiny_recipe(target_dir, write_code_corpus(tmp_path / "c.jsonl", 4), tmp_path / "o"))
    target = load_target(target_dir)
    head = build_head(recipe, target, [{"input_ids": [1, 2, 3], "loss_mask": [1, 1, 1]}])
    module = HeadWithObjective(head, target, resolve_method("eagle3").objective(), recipe.training, "float32")

    class Rank0:
        is_main_process = True

        def __init__(self, state):
            self.state = state

        def get_state_dict(self, model):
            return self.state

        def unwrap_model(self, model):
            return model

    full = module.state_dict()
    save_head(Rank0(full), module, tmp_path / "whole", torch.float32)
    saved = load_file(str(tmp_path / "whole" / "model.safetensors"))
    assert saved.keys() == head.state_dict().keys()
    assert all(torch.equal(saved[k], head.state_dict()[k]) for k in saved)
    save_head(Rank0(full), module, tmp_path / "bf16", torch.bfloat16)  # the default save_dtype: floats rounded
    rounded = load_file(str(tmp_path / "bf16" / "model.safetensors"))
    for name, tensor in head.state_dict().items():
        want = tensor.to(torch.bfloat16) if tensor.is_floating_point() else tensor
        assert rounded[name].dtype == want.dtype and torch.equal(rounded[name], want)
    shard = {k: v[: max(1, v.shape[0] // 2)] if v.dim() else v for k, v in full.items()}  # rank 0's half
    with pytest.raises(RuntimeError, match="size mismatch"):
        save_head(Rank0(shard), module, tmp_path / "shard", torch.float32)
    assert not (tmp_path / "shard").exists()


if __name__ == "__main__":  # a worker launched by _fsdp
    _select_fsdp_on_cpu()
    from draftsmith.train.cli import main

    sys.exit(main(sys.argv[1:]))
