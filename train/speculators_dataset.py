"""Offline training on speculators' own data: `data.hidden_states_dir` naming a folder that
`speculators prepare-data` and `speculators generate-offline-data` wrote.

That folder is a HF `datasets` folder (`save_to_disk`) with a record per sample (`input_ids`, `loss_mask`,
`seq_len`) and `hidden_states/hs_<i>.safetensors` for record i: `token_ids` [tokens] and `hidden_states`
[tokens, layers, hidden] as vLLM's `extract_hidden_states` gives them, bf16, or FP8 with
`hidden_states_scales` [tokens, 1, 1] (hs_connectors' FP8 connector, one scale per token).

The files do not say which layers they hold. speculators has vLLM capture a head's feature layers and the
final decoder layer's output before the final norm, and vLLM stacks the layers it keeps in ascending order,
each once (vLLM's layer i is the output of i decoder layers, as HF's hidden_states[i]); this reader takes them
so, checks the count and width, and applies the target's final norm to the last, as draftsmith's own capture
of vLLM does (`train.vllm_capture`). Samples longer than `max_length` are cut to it, as a tokenized record is.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from draftsmith.errors import DraftsmithError
from draftsmith.models.config import TargetConfig
from draftsmith.train.vllm_capture import features_of_layers, final_norm_weight, stacked_layers

HIDDEN_STATES = "hidden_states"
SCALES = "hidden_states_scales"


def is_speculators_dataset(directory: str | Path) -> bool:
    directory = Path(directory)
    return (directory / "dataset_info.json").is_file() and (directory / HIDDEN_STATES).is_dir()


class SpeculatorsDataset(torch.utils.data.Dataset):
    """A speculators offline dataset read as draftsmith's captures are (`train.capture.CapturedDataset`):
    {input_ids, loss_mask, features, last} per sample, the features as `dtype`."""

    def __init__(self, directory: str | Path, feature_layers: tuple[int, ...], target_dir: str | Path,
                 dtype: torch.dtype = torch.bfloat16, max_length: int | None = None):
        from datasets import load_from_disk

        self.directory = Path(directory)
        self.records = load_from_disk(str(self.directory)).with_format(None)
        missing = sorted(set(range(len(self.records))) - self._written())
        if missing:
            raise DraftsmithError(f"{self.directory} lacks the hidden states of {len(missing)} of its "
                                  f"{len(self.records)} samples (first: {self._file(missing[0])}): finish "
                                  "`speculators generate-offline-data` first")
        config = TargetConfig.from_model_dir(Path(target_dir))
        self.layers = stacked_layers(feature_layers, config.num_hidden_layers)
        self.feature_layers, self.dtype, self.max_length = tuple(feature_layers), dtype, max_length
        self.norm_weight, self.eps = final_norm_weight(Path(target_dir)), config.rms_norm_eps
        with safe_open(str(self._file(0)), framework="pt") as f:
            shape = f.get_slice(HIDDEN_STATES).get_shape()
        if len(shape) != 3 or shape[1:] != [len(self.layers), config.hidden_size]:
            raise DraftsmithError(f"{self._file(0)} holds hidden states of shape {shape}; the head reads "
                                  f"[tokens, {len(self.layers)}, {config.hidden_size}]: layers {self.layers} (its "
                                  "feature layers and the target's last, in vLLM's order)")

    def _file(self, i: int) -> Path:
        return self.directory / HIDDEN_STATES / f"hs_{i}.safetensors"

    def _written(self) -> set[int]:
        names = (p.name for p in (self.directory / HIDDEN_STATES).glob("hs_*.safetensors"))
        return {int(n[3:-12]) for n in names if n[3:-12].isdigit()}

    def __len__(self) -> int:
        return len(self.records)

    def tokens(self, i: int) -> dict[str, list[int]]:
        """Sample i's input_ids and loss_mask alone."""
        record, end = self.records[i], self.max_length
        return {"input_ids": [int(t) for t in record["input_ids"][:end]],
                "loss_mask": [int(m) for m in record["loss_mask"][:end]]}

    def __getitem__(self, i: int) -> dict:
        tokens = self.tokens(i)
        written = load_file(str(self._file(i)))
        if written["token_ids"][: self.max_length].tolist() != tokens["input_ids"]:
            raise DraftsmithError(f"{self._file(i)} holds the hidden states of other tokens than record {i}'s")
        stacked = written[HIDDEN_STATES][: self.max_length]
        if SCALES in written:
            stacked = stacked.float() * written[SCALES][: self.max_length].float()
        return {**tokens, **features_of_layers(stacked, self.layers, self.feature_layers, self.norm_weight,
                                               self.eps, self.dtype)}
