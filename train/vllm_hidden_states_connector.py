"""vLLM's hidden-states connector, made to run on CPU too: what `draftsmith capture --engine vllm` loads into vLLM.

vLLM's `extract_hidden_states` speculative method keeps each prompt position's hidden states at the layers
asked for (`eagle_aux_hidden_state_layer_ids`) in a cache of their own, and its example connector
(`ExampleHiddenStatesConnector`) writes a finished request's to a safetensors file: `hidden_states`
[tokens, layers, hidden] and `token_ids`. That connector copies through CUDA streams and events. Here, where
the cache is on the CPU, the copy and the write are done at once instead, and the request is reported done
by the same poll (`get_finished`); on CUDA the example's own asynchronous path runs unchanged. It reads the
example's private fields (vLLM 0.32's): a vLLM without them is refused at load, in one line.

Imported by vLLM, by module name (`kv_connector_module_path`), in the vLLM venv: it imports vLLM and is not
part of draftsmith's own import graph.
"""

from __future__ import annotations

import os

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    extract_from_kv_cache,
)

if not all(hasattr(ExampleHiddenStatesConnector, name) for name in ("_submit_async_write", "get_finished")):
    raise ImportError("this vLLM's ExampleHiddenStatesConnector is not 0.32's: capture --engine vllm needs vLLM 0.32")


class _Written:
    """Stands for the example's copy-done CUDA event: the write is over before it is recorded."""

    @staticmethod
    def query() -> bool:
        return True


class DraftsmithHiddenStatesConnector(ExampleHiddenStatesConnector):
    def _submit_async_write(self, pending) -> None:
        if not self._is_tp_rank_zero or self._kv_cache is None or self._kv_cache.device.type != "cpu":
            return super()._submit_async_write(pending)
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        slots = (torch.arange(self._block_size)[None, :] + blocks[:, None] * self._block_size).flatten()
        hidden = extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0]).clone()
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        save_file({"hidden_states": hidden, "token_ids": pending.token_ids.clone()}, pending.filename)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is not None:
            os.close(lock_fd)  # readers waiting on the file's lock may read it now
        # reported as sent by the poll that called this (`get_finished`), so the scheduler frees its blocks
        self._req_copy_events[pending.req_id] = _Written()
