"""Offline hidden states: `draftsmith capture` writes target features as safetensors shards + a manifest.

Each shard holds a run of samples concatenated along tokens: `input_ids`, `loss_mask`, `offsets` (sample
boundaries), `features` (the head's feature layers) and `last` (final normed hidden; omitted when it equals
`features`, as for EAGLE), both as `data.hidden_states_dtype` says (`train.feature_storage`: FP8 adds
`features_scale` and `last_scale`). A shard is written to a temporary name and renamed when complete, and the
manifest lists finished shards, so a killed capture resumes at the first missing shard.

The features come from a `FeatureSource`: draftsmith's own target (`TargetFeatures`), or vLLM's
(`train.vllm_capture.VllmFeatures`), read back and stored alike.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Protocol

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm

from draftsmith.errors import DraftsmithError
from draftsmith.models.dtypes import DTYPES
from draftsmith.train.feature_storage import SCALE_SUFFIX, bytes_per_token, compute_dtype, decode, encode
from draftsmith.train.objectives import target_features

MAX_OPEN_SHARDS = 256  # shard files a dataset keeps open (memory-mapped), well under the usual 1024 descriptors


def bytes_needed(num_tokens: int, feature_layers: int, hidden: int, store_last: bool, storage: str) -> int:
    per_token = bytes_per_token(feature_layers * hidden, feature_layers, storage) + 5  # + ids, mask
    if store_last:
        per_token += bytes_per_token(hidden, 1, storage)
    return num_tokens * per_token


class FeatureSource(Protocol):
    """What a capture reads features from: the target's shape, and each sample's features."""

    hidden_size: int
    num_hidden_layers: int

    def features(self, samples: list[list[int]], feature_layers: tuple[int, ...],
                 dtype: torch.dtype) -> list[dict[str, torch.Tensor]]:
        """Each sample's {features [tokens, len(feature_layers) * hidden], last [tokens, hidden]} on the CPU, as
        `dtype`: its feature layers (HF hidden_states indices) concatenated, and its final normed hidden."""

    def close(self, keep_log: bool = False) -> None:
        """Releases what the source started; `keep_log`: a failure's log stays for the user to read."""


class TargetFeatures:
    """draftsmith's own target as a capture's feature source: one sample per forward (captured values must not
    depend on what was batched beside them)."""

    def __init__(self, target):
        self.target = target
        self.hidden_size, self.num_hidden_layers = target.config.hidden_size, target.config.num_hidden_layers

    def features(self, samples: list[list[int]], feature_layers: tuple[int, ...],
                 dtype: torch.dtype) -> list[dict[str, torch.Tensor]]:
        device = self.target.model.embed_tokens.weight.device
        storage = next(name for name, value in DTYPES.items() if value == dtype)
        out = []
        for ids in samples:
            feats = target_features(self.target, tuple(feature_layers), torch.tensor(ids, device=device)[None],
                                    storage)
            out.append({"features": feats["features"][0].cpu(), "last": feats["last"][0].cpu()})
        return out

    def close(self, keep_log: bool = False) -> None:
        pass  # nothing started, nothing logged


def capture(source: FeatureSource, feature_layers: tuple[int, ...], tokenized, out_dir: str | Path,
            dtype: str = "bfloat16", samples_per_shard: int = 64, meta: dict | None = None) -> Path:
    """Reads `source`'s features for `tokenized` (input_ids, loss_mask records) and writes shards to out_dir."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    manifest_path = out_dir / "manifest.json"
    store_last = tuple(feature_layers) != (source.num_hidden_layers,)
    config = {"aux_layer_ids": list(feature_layers), "dtype": dtype, "num_samples": len(tokenized),
              "samples_per_shard": samples_per_shard, "store_last": store_last, **(meta or {})}
    manifest = {"config": config, "shards": []}
    if manifest_path.is_file():
        previous = json.loads(manifest_path.read_text())
        if previous["config"] != config:
            raise DraftsmithError(f"{out_dir} holds a capture with different settings; use another directory")
        manifest = previous
    done = {s["file"] for s in manifest["shards"]}
    total_tokens = sum(len(r) for r in tokenized["input_ids"])
    need = bytes_needed(total_tokens, len(feature_layers), source.hidden_size, store_last, dtype)
    print(f"capture: {len(tokenized)} samples, {total_tokens} tokens -> about {need / 2**20:.1f} MiB in {out_dir}"
          + (f" ({len(done)} shards already done)" if done else ""), flush=True)
    shard_starts = range(0, len(tokenized), samples_per_shard)
    for shard_index, first in enumerate(tqdm(shard_starts, desc="capture", unit="shard")):
        name = f"shard_{shard_index:05d}.safetensors"
        if name in done:
            continue
        records = tokenized.select(range(first, min(first + samples_per_shard, len(tokenized))))
        read_as = torch.float32 if dtype == "fp8" else DTYPES[dtype]  # FP8 scales from unrounded values
        feats = source.features([list(r["input_ids"]) for r in records], tuple(feature_layers), read_as)
        ids = [torch.tensor(r["input_ids"], dtype=torch.int32) for r in records]
        tensors = {"input_ids": torch.cat(ids),
                   "loss_mask": torch.cat([torch.tensor(r["loss_mask"], dtype=torch.uint8) for r in records]),
                   "offsets": torch.tensor([0] + [len(x) for x in ids]).cumsum(0)}
        stored = {"features": len(feature_layers), "last": 1} if store_last else {"features": len(feature_layers)}
        for key, layers in stored.items():
            for suffix, values in encode(torch.cat([f[key] for f in feats]), layers, dtype).items():
                tensors[key + suffix] = values
        tmp = out_dir / (name + ".tmp")
        save_file(tensors, str(tmp))
        os.replace(tmp, out_dir / name)
        manifest["shards"].append({"file": name, "first_sample": first, "num_samples": len(records)})
        tmp_manifest = manifest_path.with_suffix(".tmp")
        tmp_manifest.write_text(json.dumps(manifest, indent=2))
        os.replace(tmp_manifest, manifest_path)
    return out_dir


class CapturedDataset(torch.utils.data.Dataset):
    """Reads `capture` output back as {input_ids, loss_mask, features, last} per sample: features as stored,
    or from FP8 decoded to bf16 (`train.feature_storage.compute_dtype`)."""

    def __init__(self, directory: str | Path, feature_layers: tuple[int, ...]):
        directory = Path(directory)
        manifest_path = directory / "manifest.json"
        if not manifest_path.is_file():
            raise DraftsmithError(f"{directory} has no manifest.json: run `draftsmith capture` first")
        manifest = json.loads(manifest_path.read_text())
        config = manifest["config"]
        if tuple(config["aux_layer_ids"]) != tuple(feature_layers):
            raise DraftsmithError(f"{directory} captured layers {config['aux_layer_ids']}, the head reads "
                                  f"{list(feature_layers)}")
        covered = sum(s["num_samples"] for s in manifest["shards"])
        if covered != config["num_samples"]:
            raise DraftsmithError(f"{directory} is incomplete ({covered}/{config['num_samples']} samples): "
                                  "rerun `draftsmith capture` to resume it")
        self.store_last = config["store_last"]
        self.fp8 = config["dtype"] == "fp8"
        self.index = []  # sample -> (file, position in shard)
        for shard in sorted(manifest["shards"], key=lambda s: s["first_sample"]):
            self.index += [(directory / shard["file"], i) for i in range(shard["num_samples"])]
        # per shard: its open file and sample offsets. Samples come shuffled, so a sample reads its own rows
        # (safetensors slices, memory-mapped), not its whole shard: loading one 64-sample shard per sample
        # had copied 59 MB to train on 0.9 MB (the demo DFlash recipe's six layers of features).
        self._files: dict[Path, tuple] = {}

    def __len__(self) -> int:
        return len(self.index)

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_files"] = {}  # open files do not pickle (DataLoader workers): each opens its own
        return state

    def _shard(self, path: Path) -> tuple:
        if path not in self._files:
            if len(self._files) >= MAX_OPEN_SHARDS:
                self._files.clear()
            handle = safe_open(str(path), framework="pt")
            self._files[path] = (handle, handle.get_tensor("offsets").tolist())
        return self._files[path]

    def tokens(self, i: int) -> dict[str, list[int]]:
        """Sample i's input_ids and loss_mask alone."""
        path, j = self.index[i]
        handle, offsets = self._shard(path)
        return {key: handle.get_slice(key)[offsets[j]:offsets[j + 1]].long().tolist()
                for key in ("input_ids", "loss_mask")}

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        path, j = self.index[i]
        handle, offsets = self._shard(path)
        lo, hi = offsets[j], offsets[j + 1]
        features = ("features", "last") if self.store_last else ("features",)
        stored = ("input_ids", "loss_mask") + features + (tuple(k + SCALE_SUFFIX for k in features) if self.fp8 else ())
        rows = {key: handle.get_slice(key)[lo:hi] for key in stored}
        item = {"input_ids": rows["input_ids"].long().tolist(), "loss_mask": rows["loss_mask"].long().tolist()}
        for key in features:
            item[key] = decode(rows[key], rows[key + SCALE_SUFFIX], compute_dtype("fp8")) if self.fp8 else rows[key]
        item["last"] = item["last"] if self.store_last else item["features"]
        return item
