"""Reading draft checkpoints as they are published: config.json plus safetensors or `.bin`/`.pt` weights,
single or sharded, without executing anything from them.

`.bin`/`.pt` files load with `torch.load(weights_only=True)` only (plain tensors, no pickled code).
Sharded checkpoints are read through their index, opening only the shards that hold requested tensors, so
pulling one MTP layer out of a many-shard target reads that layer's shards and nothing else.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from draftsmith.errors import DraftsmithError
from draftsmith.models.safetensors_index import read_weight_map

# In the order a loader should prefer them (yuhuili's `from_pretrained` tries the .bin first, but a
# directory holding both is always a re-save, and safetensors is the safer read).
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json", "medusa_lm_head.safetensors", "medusa_lm_head.pt")


def local_directory(name: str, beside: Path, holding: str | None = None) -> Path | None:
    """`name` (a recorded target path, say) as a directory here, resolved: as it is (absolute, or relative to
    the working directory), else relative to `beside` (the checkpoint naming it); with `holding`, only one
    that holds that file. None where neither is (a hub id, say: draftsmith never downloads)."""
    for base in (Path.cwd(), beside):
        if name and (base / name).is_dir() and (holding is None or (base / name / holding).is_file()):
            return (base / name).resolve()
    return None


def _unreadable(path: Path, exc: Exception) -> DraftsmithError:
    return DraftsmithError(f"{path} cannot be read ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); "
                           "the file may be truncated or corrupted")


def _load_pickle(path: Path) -> dict[str, torch.Tensor]:
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # UnpicklingError, RuntimeError from the zip reader, EOFError...
        if "weights_only" in str(exc) or "Unsupported global" in str(exc):
            raise DraftsmithError(f"{path} holds objects other than tensors; only plain tensor state dicts are "
                                  "loaded (torch.load with weights_only=True), nothing from the file is executed") from None
        raise _unreadable(path, exc) from None
    if isinstance(state, dict) and "state_dict" in state and isinstance(state["state_dict"], dict):
        state = state["state_dict"]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise DraftsmithError(f"{path} is not a state dict of tensors")
    return dict(state)


class _SafetensorsFile:
    def __init__(self, path: Path):
        self.path = path
        try:
            with safe_open(str(path), framework="pt") as f:
                self.shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
        except (SafetensorError, OSError, ValueError) as exc:
            raise _unreadable(path, exc) from None

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        try:
            with safe_open(str(self.path), framework="pt") as f:
                return {name: f.get_tensor(name) for name in names}
        except (SafetensorError, OSError, ValueError) as exc:
            raise _unreadable(self.path, exc) from None


class _PickleFile:
    def __init__(self, path: Path):
        self.path = path
        self._state = _load_pickle(path)
        self.shapes = {k: tuple(v.shape) for k, v in self._state.items()}

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        return {name: self._state[name] for name in names}


def _open_weight_file(path: Path):
    return _SafetensorsFile(path) if path.suffix == ".safetensors" else _PickleFile(path)


class SourceCheckpoint:
    """A checkpoint directory (or one weights file): its config and a lazy view of its tensors."""

    def __init__(self, path: str | Path):
        path = Path(path)
        if not path.exists():
            raise DraftsmithError(f"checkpoint {str(path)!r} does not exist")
        self.path = path
        self.directory = path if path.is_dir() else path.parent
        self.config: dict[str, Any] = self._read_config()
        self.weights_file = self._find_weights(path)
        self._files: dict[Path, Any] = {}
        self._where: dict[str, Path] = {}
        if self.weights_file.name.endswith(".index.json"):
            self._where = read_weight_map(self.weights_file)
            self._shapes: dict[str, tuple[int, ...]] | None = None
        else:
            file = self._file(self.weights_file)
            self._where = dict.fromkeys(file.shapes, self.weights_file)
            self._shapes = dict(file.shapes)

    def _read_config(self) -> dict[str, Any]:
        path = self.directory / "config.json"
        if not path.is_file():
            return {}
        try:
            config = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise DraftsmithError(f"{path} is not valid JSON: {exc}") from None
        if not isinstance(config, dict):
            raise DraftsmithError(f"{path} does not hold a JSON object")
        return config

    def _find_weights(self, path: Path) -> Path:
        if path.is_file():
            return path
        for name in WEIGHT_FILES:
            if (path / name).is_file():
                return path / name
        raise DraftsmithError(f"{path} holds none of the weight files draftsmith reads ({', '.join(WEIGHT_FILES)})")

    def _file(self, path: Path):
        if path not in self._files:
            self._files[path] = _open_weight_file(path)
        return self._files[path]

    @property
    def names(self) -> list[str]:
        return list(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        """Shape without loading the tensor (only the shard's header, for safetensors)."""
        if self._shapes is not None:
            return self._shapes[name]
        return self._file(self._where[name]).shapes[name]

    def has(self, name: str) -> bool:
        return name in self._where

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        """The named tensors, opening only the files that hold them."""
        unknown = [n for n in names if n not in self._where]
        if unknown:
            raise DraftsmithError(f"{self.path} has no tensor {unknown[0]!r}")
        by_file: dict[Path, list[str]] = {}
        for name in names:
            by_file.setdefault(self._where[name], []).append(name)
        out: dict[str, torch.Tensor] = {}
        for file, file_names in by_file.items():
            out.update(self._file(file).read(file_names))
        return out


# where HF checkpoints keep the input embedding (text models; multimodal ones nest the language model)
EMBEDDING_NAMES = ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight")


# where they keep the output projection; a model with tied embeddings keeps none, and reads out through the input one
LM_HEAD_NAMES = ("lm_head.weight", "model.language_model.lm_head.weight", "language_model.lm_head.weight")


def _first_of(name: str, candidates: tuple[str, ...], shape: tuple[int, ...]) -> torch.Tensor | None:
    """The first of `candidates` the model directory `name` holds with `shape`, where it is one here."""
    if not name or not (Path(name) / "config.json").is_file():
        return None
    target = SourceCheckpoint(name)
    for weight in candidates:
        if target.has(weight) and target.shape(weight) == tuple(shape):
            return target.read([weight])[weight]
    return None


def target_embedding(name: str, shape: tuple[int, ...]) -> torch.Tensor | None:
    """The input embedding of the model directory `name`, where it is one here and holds one of `shape`."""
    return _first_of(name, EMBEDDING_NAMES, shape)


def target_lm_head(name: str, shape: tuple[int, ...]) -> torch.Tensor | None:
    """The output projection of the model directory `name` (its input embedding where the two are tied), where
    it is one here and holds one of `shape`."""
    return _first_of(name, LM_HEAD_NAMES + EMBEDDING_NAMES, shape)

