"""What a training checkpoint may hold before it is resumed: the progress counters as JSON, and pickles that
load as plain data.

accelerate resumes with `torch.load`, and a pickle can name any function to call while it loads; some
accelerate versions load some of their files (registered objects' `custom_checkpoint_*.pkl` always) with
`weights_only=False`. So draftsmith keeps its own counters in `progress.json` and, before `load_state`,
loads every file torch would unpickle with `weights_only=True`: a file that needs code to load is refused,
with nothing from it run.

Two kinds of checkpoint hold more than torch's plain data. FSDP's sharded one is a torch.distributed.checkpoint
(DCP) folder whose `.metadata` index torch reads with a bare `pickle.load`, and whose non-tensor entries (the
optimizer's param_groups) it loads with `weights_only=False`: the index must unpickle from DCP's own data
records, and those entries with `weights_only=True`. DeepSpeed's ZeRO files pickle a few DeepSpeed classes,
allowed by name where deepspeed is installed.
"""

from __future__ import annotations

import enum
import functools
import importlib
import io
import json
import pickle
import re
import sys
import tempfile
import warnings
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields
from pathlib import Path, PosixPath
from typing import BinaryIO

import torch

from draftsmith.errors import DraftsmithError

PROGRESS_FILE = "progress.json"
LEGACY_PROGRESS_FILE = "custom_checkpoint_0.pkl"
PICKLE_SUFFIXES = (".pkl", ".bin", ".pt", ".pth")  # what torch.load reads; safetensors and JSON hold no code
_CUSTOM_PICKLE = re.compile(r"^custom_checkpoint_\d+\.pkl$")  # accelerate's name for registered objects
_GO_ON = "nothing from it was run. Delete the file or the checkpoint to go on"
_WEIGHTS_ONLY = "torch.load weights_only=True"
_DCP_RECORDS = "the DCP metadata allowlist"
DCP_INDEX = re.compile(r"^(__\d+)?\.metadata$")  # `.metadata`, or `__<rank>.metadata` when saved per rank
_DCP = "torch.distributed.checkpoint"

# DeepSpeed's classes in the ZeRO stage 1-3 files of accelerate's DeepSpeed save_state (found by saving them with
# deepspeed 0.19.8 in fp32, bf16 and fp16). Each is built from its fields: no code of the file's choosing runs.
DEEPSPEED_GLOBALS = (
    ("deepspeed.runtime.zero.config", "ZeroStageEnum"),  # *_optim_states.pt: optimizer_state_dict["zero_stage"]
    ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"),  # ...["loss_scaler"] in fp32 and bf16
    ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler"),  # ...["loss_scaler"] in fp16
    ("deepspeed.utils.tensor_fragment", "fragment_address"),  # ZeRO-1/2: ...["param_slice_mappings"] values
)


@dataclass
class Progress:
    """Counters saved with every checkpoint, in its `progress.json`."""

    step: int = 0  # optimizer steps done
    epoch: int = 0
    batches_in_epoch: int = 0  # micro-batches of `epoch` already consumed


def write_progress(folder: Path, progress: Progress) -> None:
    (folder / PROGRESS_FILE).write_text(json.dumps(asdict(progress)) + "\n")


def read_progress(folder: Path) -> Progress:
    """The checkpoint's counters: `progress.json`, or in a checkpoint without one, the plain dict of ints that
    accelerate pickled for a registered `Progress` in `custom_checkpoint_0.pkl` (read with weights_only=True)."""
    path = folder / PROGRESS_FILE
    if path.is_file():
        try:
            return _as_progress(json.loads(path.read_text()), path)
        except json.JSONDecodeError as exc:
            raise DraftsmithError(f"{path} is not JSON ({exc}): delete the checkpoint to go on") from None
    legacy = folder / LEGACY_PROGRESS_FILE
    if legacy.is_file():
        return _as_progress(_load_weights_only(legacy), legacy)
    raise DraftsmithError(f"{folder} holds no {PROGRESS_FILE}, so the step to resume from is unknown: "
                          "delete the checkpoint to go on")


def _as_progress(state, path: Path) -> Progress:
    names = {f.name for f in fields(Progress)}
    if not isinstance(state, dict) or set(state) != names or any(type(v) is not int for v in state.values()):
        raise DraftsmithError(f"{path} does not hold the progress counters ({', '.join(sorted(names))}) as "
                              "integers: delete the checkpoint to go on")
    return Progress(**state)


def refuse_code_pickles(folder: Path) -> None:
    """Raises a DraftsmithError naming the first file under `folder` that torch would unpickle and that does
    not load as plain data. A `custom_checkpoint_*.pkl` is refused beside a `progress.json` even when it is
    plain data: draftsmith writes none, and accelerate would load it with weights_only=False."""
    has_progress = (folder / PROGRESS_FILE).is_file()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        if DCP_INDEX.match(path.name):
            _refuse_code_in_dcp(path)
        elif path.suffix in PICKLE_SUFFIXES:
            if _CUSTOM_PICKLE.match(path.name) and (has_progress or path.name != LEGACY_PROGRESS_FILE):
                raise DraftsmithError(f"refusing to resume from {path}: draftsmith keeps its progress in "
                                      f"{PROGRESS_FILE} and writes no custom_checkpoint pickle; {_GO_ON}")
            _load_or_refuse(path, functools.partial(_load_weights_only, path), _WEIGHTS_ONLY)


def _load_or_refuse(path: Path, load: Callable[[], object], loader: str, entry: str = ""):
    """`load()`, or where it raises, a one-line DraftsmithError naming `path` (and the `entry` read from it)."""
    where = f"{path} (its entry {entry!r})" if entry else str(path)
    try:
        return load()
    except pickle.UnpicklingError as exc:
        raise DraftsmithError(f"refusing to resume from {where}: it is a pickle that needs code to load "
                              f"({loader} refused it: {_reason(exc)}); {_GO_ON}") from None
    except Exception as exc:  # a truncated or foreign file: one line, not a traceback
        raise DraftsmithError(f"refusing to resume from {where}: {loader} cannot read it "
                              f"({type(exc).__name__}: {_reason(exc)}); {_GO_ON}") from None


def _load_weights_only(source: Path | BinaryIO):
    """Loads `source` as plain data; only accelerate's RNG-state numpy globals and DeepSpeed's few classes are
    allowed beyond torch's own. torch.save's zip files are memory-mapped, so a large optimizer state is not
    read into memory twice."""
    mmap = isinstance(source, Path) and zipfile.is_zipfile(source)
    with torch.serialization.safe_globals([*numpy_globals(), *deepspeed_globals()]), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch's note on a refused file's pickle protocol
        return torch.load(source, map_location="cpu", weights_only=True, mmap=mmap)


def _refuse_code_in_dcp(index: Path) -> None:
    """Checks a DCP index and the entries it points at that DCP would unpickle unrestricted: torch's
    FileSystemReader loads the index with `pickle.load`, and its planner loads each non-tensor entry of the
    `.distcp` files with `torch.load(weights_only=False)` (tensors it loads with weights_only=True)."""
    entries = _load_or_refuse(index, functools.partial(_dcp_pickled_entries, index), _DCP_RECORDS)
    for fqn, file, offset, length, transforms in entries:
        if transforms:  # DCP's stream extensions (compression): what they decode is not checked here
            raise DraftsmithError(f"refusing to resume from {file} (its entry {fqn!r}): it is stored through "
                                  f"the DCP transforms {transforms}, which draftsmith does not check; {_GO_ON}")
        _load_or_refuse(file, functools.partial(_load_slice, file, offset, length), _WEIGHTS_ONLY, entry=fqn)


def _dcp_pickled_entries(index: Path) -> list[tuple[str, Path, int, int, tuple]]:
    """(fqn, file, offset, length, transforms) of each entry the DCP index `index` does not describe as a
    tensor, read through `_DcpIndexUnpickler`; a ValueError where it holds no DCP Metadata."""
    from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata

    with index.open("rb") as f:
        metadata = _DcpIndexUnpickler(f).load()
    described, stored = getattr(metadata, "state_dict_metadata", None), getattr(metadata, "storage_data", None)
    if not (isinstance(metadata, Metadata) and isinstance(described, dict) and isinstance(stored, dict)):
        raise ValueError("it holds no DCP Metadata with state_dict_metadata and storage_data")
    entries = []
    for key, info in stored.items():
        if not isinstance(key, MetadataIndex):
            raise ValueError(f"a storage_data key is a {type(key).__name__}, not a MetadataIndex")
        if not isinstance(described.get(key.fqn), TensorStorageMetadata):
            entries.append((str(key.fqn), index.parent / info.relative_path, int(info.offset), int(info.length),
                            tuple(getattr(info, "transform_descriptors", None) or ())))
    return entries


def _load_slice(file: Path, offset: int, length: int):
    """The `length` bytes at `offset` of `file`, loaded as plain data: what DCP hands its planner's torch.load."""
    with file.open("rb") as f:
        f.seek(offset)
        return _load_weights_only(io.BytesIO(f.read(length)))


class _DcpIndexUnpickler(pickle.Unpickler):
    """Unpickles a DCP `.metadata` from its data records alone. Every other global is refused by its name,
    so nothing the file names is imported or called."""

    def find_class(self, module: str, name: str):
        found = _dcp_record_global(module, name)
        if found is None:
            raise pickle.UnpicklingError(f"global '{module}.{name}' is not a DCP metadata record")
        return found


def _dcp_record_global(module: str, name: str):
    """The global `module.name` if a DCP index may hold it, else None: a dataclass or enum defined in DCP itself
    (built from its fields; any other class's constructor would run with arguments the file chose), a torch
    dtype, or one of the three other globals a real index holds."""
    # vars(), not getattr: torch's module __getattr__ would import a submodule the file named
    if module == _DCP or module.startswith(_DCP + "."):
        importlib.import_module(_DCP)  # loads DCP's modules; none is imported by a name the file chose
        found = vars(sys.modules[module]).get(name) if module in sys.modules else None
        # defined there (not imported into it), and itself a dataclass (not a subclass with its own __init__)
        is_record = isinstance(found, type) and found.__module__ == module and (
            "__dataclass_fields__" in vars(found) or issubclass(found, enum.Enum))
        return found if is_record else None
    if module == "torch" and isinstance(vars(torch).get(name), torch.dtype):  # TensorProperties.dtype
        return vars(torch)[name]
    extra = (torch.Size,  # chunk offsets and sizes
             torch.serialization._get_layout,  # TensorProperties.layout: looks torch.strided up by its name
             PosixPath)  # StorageMeta.checkpoint_id: the folder it was saved to
    return next((g for g in extra if (g.__module__, g.__name__) == (module, name)), None)


def _reason(exc: Exception) -> str:
    """One line from torch's many-line refusal: the unpickler's own complaint, without its advice to allowlist
    the very global that runs the code."""
    text = str(exc)
    _, found, rest = text.partition("WeightsUnpickler error:")
    lines = [line.strip() for line in (rest if found else text).splitlines() if line.strip()]
    return lines[0].split(". ")[0] if lines else "no message"


def numpy_globals() -> list:
    """accelerate's `TORCH_SAFE_GLOBALS`: the numpy array and dtype reconstructors its RNG-state file needs."""
    try:
        from accelerate.utils.other import TORCH_SAFE_GLOBALS
    except ImportError:  # an accelerate that keeps no such list
        return own_numpy_globals()
    return list(TORCH_SAFE_GLOBALS)


@functools.cache
def deepspeed_globals() -> tuple:
    """The `DEEPSPEED_GLOBALS` classes, looked up by name where deepspeed is installed (and so imported only
    then); a class that a deepspeed version lacks is left out, so its files are refused rather than run."""
    found = []
    for module, name in DEEPSPEED_GLOBALS:
        try:
            found.append(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError):
            continue
    return tuple(found)


def own_numpy_globals() -> list:
    """The same entries as accelerate's list, for an accelerate without one."""
    import codecs

    import numpy as np

    core = np._core if hasattr(np, "_core") else np.core
    dtypes = [np.dtypes.UInt32DType] if hasattr(np, "dtypes") else []  # numpy >= 1.25
    return [core.multiarray._reconstruct, np.ndarray, codecs.encode, np.dtype, *dtypes]


@contextmanager
def without_custom_pickles(folder: Path) -> Iterator[Path]:
    """`folder`, or where it holds `custom_checkpoint_*.pkl` files, a temporary view of it without them: accelerate
    refuses a folder holding more of them than registered objects, and draftsmith registers none."""
    hidden = [p for p in folder.iterdir() if _CUSTOM_PICKLE.match(p.name)]
    if not hidden:
        yield folder
        return
    with tempfile.TemporaryDirectory(prefix="draftsmith-resume-") as view:
        for entry in folder.iterdir():
            if entry not in hidden:
                (Path(view) / entry.name).symlink_to(entry.resolve())
        yield Path(view)
