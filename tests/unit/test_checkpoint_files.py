"""The resume check: plain-data pickles, safetensors and JSON pass; a pickle that runs code is refused unrun."""

import json
import pickle
import random
import re
import warnings
from collections import OrderedDict

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from draftsmith.errors import DraftsmithError
from draftsmith.train.checkpoint_files import (
    DEEPSPEED_GLOBALS,
    Progress,
    deepspeed_globals,
    numpy_globals,
    own_numpy_globals,
    read_progress,
    refuse_code_pickles,
    without_custom_pickles,
    write_progress,
)


class RunsCode:
    """Writes `marker` when unpickled: what a planted checkpoint file does."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('ran')",)


@pytest.fixture
def checkpoint(tmp_path):
    """A folder shaped like an accelerate checkpoint: safetensors weights, torch-saved optimizer and RNG state
    (numpy arrays, which need accelerate's allowlisted globals), JSON progress and a YAML recipe."""
    folder = tmp_path / "step_00000002"
    folder.mkdir()
    save_file({"w": torch.ones(2, 3)}, folder / "model.safetensors")
    torch.save({"state": {0: {"exp_avg": torch.zeros(3)}}, "param_groups": [{"lr": 0.1}]}, folder / "optimizer.bin")
    torch.save({"random_state": random.getstate(), "numpy_random_seed": np.random.get_state(),
                "torch_manual_seed": torch.get_rng_state()}, folder / "random_states_0.pkl")
    write_progress(folder, Progress(step=2, epoch=0, batches_in_epoch=2))
    (folder / "recipe.yaml").write_text("training: {}\n")
    return folder


def test_plain_data_passes_and_progress_reads_back(checkpoint):
    refuse_code_pickles(checkpoint)
    assert read_progress(checkpoint) == Progress(step=2, epoch=0, batches_in_epoch=2)
    with without_custom_pickles(checkpoint) as view:
        assert view == checkpoint


@pytest.mark.parametrize("name, save", [("scheduler.bin", torch.save), ("pytorch_model/states.pt", torch.save),
                                        ("random_states_0.pkl", lambda obj, path: path.write_bytes(pickle.dumps(obj)))])
def test_a_code_pickle_is_refused_without_running(checkpoint, tmp_path, name, save):
    marker = tmp_path / "MARKER"
    (checkpoint / name).parent.mkdir(exist_ok=True)
    save(RunsCode(marker), checkpoint / name)
    with pytest.raises(DraftsmithError) as refused:
        refuse_code_pickles(checkpoint)
    message = str(refused.value)
    assert message.startswith(f"refusing to resume from {checkpoint / name}: it is a pickle that needs code to load")
    assert "nothing from it was run" in message and "\n" not in message
    assert "allowlist" not in message  # torch's advice to trust the global is not passed on
    assert not marker.exists()


def test_a_custom_checkpoint_pickle_is_refused_beside_progress_json(checkpoint):
    torch.save({"step": 2, "epoch": 0, "batches_in_epoch": 2}, checkpoint / "custom_checkpoint_0.pkl")
    with pytest.raises(DraftsmithError, match=r"custom_checkpoint_0.pkl: draftsmith keeps its progress in "
                                              r"progress.json .*nothing from it was run"):
        refuse_code_pickles(checkpoint)


def test_without_progress_json_the_pickled_counters_are_the_progress(checkpoint):
    (checkpoint / "progress.json").unlink()
    torch.save({"step": 7, "epoch": 1, "batches_in_epoch": 3}, checkpoint / "custom_checkpoint_0.pkl")
    refuse_code_pickles(checkpoint)
    assert read_progress(checkpoint) == Progress(step=7, epoch=1, batches_in_epoch=3)
    with without_custom_pickles(checkpoint) as view:  # what accelerate's load_state is given
        names = sorted(p.name for p in view.iterdir())
        assert "custom_checkpoint_0.pkl" not in names and "optimizer.bin" in names
        assert torch.load(view / "optimizer.bin", weights_only=True)["param_groups"] == [{"lr": 0.1}]
    torch.save({"step": 7, "epoch": 1, "batches_in_epoch": 3}, checkpoint / "custom_checkpoint_1.pkl")
    with pytest.raises(DraftsmithError, match="custom_checkpoint_1.pkl"):  # draftsmith registered one object
        refuse_code_pickles(checkpoint)


def test_unreadable_or_missing_progress_is_one_line(checkpoint):
    (checkpoint / "optimizer.bin").write_bytes(b"PK\x03\x04 truncated")
    with pytest.raises(DraftsmithError, match=r"optimizer.bin: torch.load weights_only=True cannot read it \(.*nothing from it was run"):
        refuse_code_pickles(checkpoint)
    (checkpoint / "progress.json").write_text(json.dumps({"step": "2", "epoch": 0, "batches_in_epoch": 2}))
    with pytest.raises(DraftsmithError, match="does not hold the progress counters"):
        read_progress(checkpoint)
    (checkpoint / "progress.json").unlink()
    with pytest.raises(DraftsmithError, match="holds no progress.json"):
        read_progress(checkpoint)


def test_the_allowlist_is_accelerates():
    from accelerate.utils.other import TORCH_SAFE_GLOBALS

    assert numpy_globals() == TORCH_SAFE_GLOBALS
    assert own_numpy_globals() == TORCH_SAFE_GLOBALS  # the stand-in for an accelerate without the list


def _dcp_save(state, folder):
    """What accelerate's FSDP save_state writes per sharded object: a torch.distributed.checkpoint folder."""
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is ... uninitialized, assuming ... a single process"
        dcp.save(state, checkpoint_id=folder, no_dist=True)


@pytest.fixture
def sharded(checkpoint):
    """An FSDP-style `optimizer_0` DCP folder in `checkpoint`: its param_groups are non-tensor entries, which
    DCP pickles into the `.distcp` file beside the tensors."""
    folder = checkpoint / "optimizer_0"
    _dcp_save({"state": {"w": {"exp_avg": torch.ones(2, 3), "step": torch.tensor(2.0)}},
               "param_groups": [{"lr": 0.1, "betas": (0.9, 0.95), "foreach": None, "params": ["w"]}]}, folder)
    return folder


def test_a_real_dcp_checkpoint_passes(checkpoint, sharded):
    assert sorted(p.name for p in sharded.iterdir()) == [".metadata", "__0_0.distcp"]
    refuse_code_pickles(checkpoint)


def _refusal(checkpoint) -> str:
    """The one-line refusal `refuse_code_pickles(checkpoint)` raises, which says nothing from the file ran."""
    with pytest.raises(DraftsmithError) as refused:
        refuse_code_pickles(checkpoint)
    message = str(refused.value)
    assert "nothing from it was run" in message and "\n" not in message
    return message


@pytest.mark.parametrize("name", [".metadata", "__1.metadata"])  # the index, or a rank's own one
def test_a_code_dcp_index_is_refused_without_running(checkpoint, sharded, tmp_path, name):
    marker = tmp_path / "MARKER"
    (sharded / name).write_bytes(pickle.dumps(RunsCode(marker)))  # what torch's FileSystemReader pickle.loads
    assert _refusal(checkpoint).startswith(
        f"refusing to resume from {sharded / name}: it is a pickle that needs code to load (the DCP metadata "
        "allowlist refused it: global 'builtins.exec' is not a DCP metadata record)")
    assert not marker.exists()


@pytest.mark.parametrize("module, name", [
    ("torch.distributed.checkpoint.filesystem", "FileSystemReader"),  # a DCP class that is no data record
    ("torch.distributed.checkpoint.state_dict_loader", "load"),  # a DCP function
    ("torch.distributed.checkpoint.filesystem", "Enum"),  # an enum, but imported into DCP from elsewhere
    ("torch", "load"),  # a torch global that is no dtype
])
def test_a_dcp_index_holds_only_dcp_records_and_their_few_globals(checkpoint, sharded, module, name):
    (sharded / ".metadata").write_bytes(f"c{module}\n{name}\n)R.".encode())  # calls module.name()
    with pytest.raises(DraftsmithError, match=re.escape(f"global '{module}.{name}' is not a DCP metadata record")):
        refuse_code_pickles(checkpoint)


def test_a_code_pickle_in_a_distcp_entry_is_refused_without_running(checkpoint, tmp_path):
    """DCP's planner loads a non-tensor entry with torch.load(weights_only=False)."""
    marker = tmp_path / "MARKER"
    _dcp_save({"w": torch.ones(2), "planted": RunsCode(marker)}, checkpoint / "pytorch_model_fsdp_0")
    assert _refusal(checkpoint).startswith(
        f"refusing to resume from {checkpoint / 'pytorch_model_fsdp_0' / '__0_0.distcp'} (its entry 'planted'): "
        "it is a pickle that needs code to load (torch.load weights_only=True refused it")
    assert not marker.exists()


def test_a_foreign_or_transformed_dcp_index_is_refused(checkpoint, sharded):
    index = sharded / ".metadata"
    metadata = pickle.loads(index.read_bytes())
    (sharded / "__0.metadata").write_bytes(pickle.dumps({"storage_data": {}}))  # plain data, but no DCP index
    with pytest.raises(DraftsmithError, match=r"__0.metadata: the DCP metadata allowlist cannot read it "
                                              r"\(ValueError: it holds no DCP Metadata"):
        refuse_code_pickles(checkpoint)
    (sharded / "__0.metadata").unlink()
    for info in metadata.storage_data.values():
        info.transform_descriptors = ["stream.zstd"]  # what DCP's compression extension records
    index.write_bytes(pickle.dumps(metadata))
    with pytest.raises(DraftsmithError, match=r"__0_0.distcp \(its entry 'param_groups.0.\w+'\): it is stored "
                                              r"through the DCP transforms \('stream.zstd',\)"):
        refuse_code_pickles(checkpoint)


def test_deepspeed_zero_files_pass(checkpoint):
    """A ZeRO optimizer file holding DeepSpeed's own objects, as deepspeed 0.19.8 pickles them (stages 1-3, in
    fp32, bf16 and fp16): the allowlist takes them, so a DeepSpeed resume is not refused."""
    deepspeed = pytest.importorskip("deepspeed", reason="deepspeed (the 'deepspeed' extra) is not installed")
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    assert len(deepspeed_globals()) == len(DEEPSPEED_GLOBALS)
    folder = checkpoint / "pytorch_model"
    folder.mkdir()
    scalers = [LossScaler(1.0), DynamicLossScaler(2.0**16, 1000, 1.0, 2, False, dtype=torch.float16)]
    for rank, scaler in enumerate(scalers):
        optimizer = {"zero_stage": ZeroStageEnum.gradients, "loss_scaler": scaler, "partition_count": [2],
                     "single_partition_of_fp32_groups": [torch.zeros(4)],
                     "param_slice_mappings": [OrderedDict(w=fragment_address(numel=4, start=0))]}
        torch.save({"optimizer_state_dict": optimizer, "ds_config": {"zero_optimization": {"stage": 2}},
                    "ds_version": deepspeed.__version__}, folder / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
    refuse_code_pickles(checkpoint)
