"""`draftsmith capture --engine vllm`: the target's hidden states from vLLM, written as draftsmith's own shards.

vLLM runs in a venv of its own (it pins a transformers apart from ours), as a subprocess of that venv's python
(`vllm_capture_worker.py`, started like the bench's peer: `draftsmith.vllm_process.PeerWorker`), with its
`extract_hidden_states` speculative method: each sample is a prompt whose positions' hidden states vLLM keeps
at the layers asked for and its connector (`vllm_hidden_states_connector.py`) writes to a file once the
request finishes. draftsmith tokenizes the samples and sends vLLM the ids, reads the files back, and stores
what its own capture stores (`train.capture`): the head's feature layers concatenated, and the final normed
hidden state.

vLLM's layer i is the output of i decoder layers before any norm, as HF's hidden_states[i] is, except the
last: HF's (and draftsmith's) hidden_states[num_hidden_layers] has the final norm applied, so that norm is
applied here, with the checkpoint's weight, to vLLM's unnormed last layer.
"""

from __future__ import annotations

import fcntl
import shutil
import tempfile
import time
from pathlib import Path

import safetensors
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file

from draftsmith.errors import DraftsmithError
from draftsmith.models.config import TargetConfig
from draftsmith.models.loader import safetensors_files
from draftsmith.vllm_process import DEFAULT_PYTHON, WORKER_TIMEOUT_S, PeerWorker, bind_threads

WORKER = Path(__file__).with_name("vllm_capture_worker.py")
FINAL_NORM = "model.norm.weight"
MAX_NUM_SEQS = 64  # samples in flight in vLLM, unless told


def final_norm_weight(model_dir: Path) -> torch.Tensor:
    """The final norm's weight, read alone from the checkpoint (fp32)."""
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            if FINAL_NORM in f.keys():
                return f.get_tensor(FINAL_NORM).float()
    raise DraftsmithError(f"{model_dir} has no {FINAL_NORM}: capture --engine vllm reads a Llama-style checkpoint")


def read_written(path: Path, timeout_s: float = WORKER_TIMEOUT_S) -> dict[str, torch.Tensor]:
    """A file the connector wrote, once whole: its writer holds `path.lock` until then (waited on for at most
    `timeout_s`)."""
    lock = path.with_name(path.name + ".lock")
    if lock.is_file():
        deadline = time.monotonic() + timeout_s
        with open(lock) as held:
            while True:
                try:
                    fcntl.flock(held, fcntl.LOCK_SH | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise DraftsmithError(f"vLLM did not finish writing {path} in {timeout_s:.0f} s") from None
                    time.sleep(0.01)
    try:
        return load_file(str(path))
    except (OSError, safetensors.SafetensorError) as exc:
        raise DraftsmithError(f"vLLM's hidden states in {path} cannot be read ({exc})") from None


def stacked_layers(feature_layers: tuple[int, ...], num_hidden_layers: int) -> list[int]:
    """The layers vLLM keeps for a head, in the order it stacks them: its feature layers and the last,
    ascending, each once."""
    return sorted(set(feature_layers) | {num_hidden_layers})


def features_of_layers(stacked: torch.Tensor, layers: list[int], feature_layers: tuple[int, ...],
                       norm_weight: torch.Tensor, eps: float, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """vLLM's hidden states [tokens, len(layers), hidden] at `layers` (the last of them the final layer,
    unnormed) -> {features: `feature_layers` concatenated, last: the final normed hidden}, as `dtype`."""
    by_layer = {layer: stacked[:, j].float() for j, layer in enumerate(layers)}
    last = layers[-1]
    by_layer[last] = F.rms_norm(by_layer[last], (stacked.shape[-1],), norm_weight, eps)
    return {"features": torch.cat([by_layer[i] for i in feature_layers], dim=-1).to(dtype),
            "last": by_layer[last].to(dtype)}


class VllmFeatures:
    """A capture's feature source (`train.capture.FeatureSource`) run by vLLM."""

    def __init__(self, model_dir: str | Path, feature_layers: tuple[int, ...], python: str | Path | None = None,
                 device: str = "cpu", max_model_len: int = 2048, max_num_seqs: int | None = None,
                 tensor_parallel_size: int = 1, enforce_eager: bool = False):
        python = Path(python) if python else DEFAULT_PYTHON
        if not python.is_file():
            raise DraftsmithError(f"--engine vllm: {python} not found; run `make peer-vllm` (vLLM in its own venv) "
                                  "or pass --vllm-python")
        self.model_dir = Path(model_dir)
        config = TargetConfig.from_model_dir(self.model_dir)
        self.hidden_size, self.num_hidden_layers = config.hidden_size, config.num_hidden_layers
        if max_model_len > config.max_position_embeddings:
            raise DraftsmithError(f"samples of up to {max_model_len - 1} tokens and the one vLLM generates do not fit "
                                  f"{self.model_dir.name}'s context of {config.max_position_embeddings}")
        self.norm_weight, self.eps = final_norm_weight(self.model_dir), config.rms_norm_eps
        # what vLLM keeps: the head's layers and the last one (the final normed hidden is stored too)
        self.layers = stacked_layers(feature_layers, self.num_hidden_layers)
        threads, bind = bind_threads(None) if device == "cpu" else (0, None)
        self.workdir = Path(tempfile.mkdtemp(prefix="draftsmith-capture-vllm-"))
        job = {"model": str(self.model_dir.resolve()), "dtype": "float32" if device == "cpu" else "auto",
               "max_model_len": max_model_len, "max_num_seqs": max_num_seqs or MAX_NUM_SEQS,
               "tensor_parallel_size": tensor_parallel_size, "enforce_eager": enforce_eager,
               "layers": self.layers, "storage": str(self.workdir / "hidden_states")}
        started = time.perf_counter()
        self.worker = PeerWorker(python, job, bind, threads, self.workdir, worker=WORKER)
        ready = self.worker.reply()
        if "ready" not in ready:
            self.close(keep_log=True)
            raise DraftsmithError(f"vLLM would not load {self.model_dir} to capture hidden states: "
                                  f"{ready.get('refused', ready)}; its log: {self.worker.log_path}")
        print(f"vLLM {ready['ready']['vllm_version']} loaded {self.model_dir.name} in "
              f"{time.perf_counter() - started:.0f} s (hidden states of layers {self.layers})", flush=True)

    def features(self, samples: list[list[int]], feature_layers: tuple[int, ...],
                 dtype: torch.dtype) -> list[dict[str, torch.Tensor]]:
        """Each sample's {features [tokens, len(feature_layers) * hidden], last [tokens, hidden]} as `dtype`."""
        reply = self.worker.send({"prompts": samples})
        if "paths" not in reply:
            raise DraftsmithError(f"vLLM failed a batch: {reply.get('failed', reply)}; its log: {self.worker.log_path}")
        try:
            return [self._sample(ids, Path(path), feature_layers, dtype) for ids, path in zip(samples, reply["paths"])]
        except DraftsmithError as exc:
            raise DraftsmithError(f"{exc}; vLLM's log: {self.worker.log_path}") from None

    def _sample(self, ids: list[int], path: Path, feature_layers: tuple[int, ...],
                dtype: torch.dtype) -> dict[str, torch.Tensor]:
        written = read_written(path)
        if written["token_ids"].tolist() != list(ids):
            raise DraftsmithError(f"vLLM's hidden states in {path} are for other tokens than the sample's")
        path.unlink()
        path.with_name(path.name + ".lock").unlink(missing_ok=True)
        return features_of_layers(written["hidden_states"], self.layers, feature_layers, self.norm_weight, self.eps,
                                  dtype)

    def close(self, keep_log: bool = False) -> None:
        """Stops vLLM; its folder (job, log, leftover files) is removed unless `keep_log`."""
        self.worker.close()
        if not keep_log:
            shutil.rmtree(self.workdir, ignore_errors=True)
