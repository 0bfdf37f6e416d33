"""The bench's vLLM worker (serve/bench/vllm_peer_worker.py) with a defect of vLLM's CPU build fixed that
would hide whether an export is read right. It runs in vLLM's venv, by path, as the worker does:

    build/peer-vllm/bin/python tests/vllm_oracle_worker.py JOB.json

Only what vLLM computes wrongly is fixed here; conventions in which vLLM differs by design stay as they are.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

WORKER = Path(__file__).resolve().parents[1] / "serve" / "bench" / "vllm_peer_worker.py"


def fix_dflash_context_k_norm() -> None:
    """vLLM 0.32's DFlash (qwen3_dflash.py, `DFlashQwen3Model._normalize_context_k`) norms every draft layer's
    context keys in one grouped `rms_norm` over a [layers, head_dim] weight; the CPU kernel reads only its
    first row, so every layer past the first norms its keys with layer 0's weight (demo DFlash head, k = 8:
    acceptance 2.17 as shipped, 2.40 with this). Here each layer's own weight, in torch."""
    import torch
    from vllm.model_executor.models import qwen3_dflash

    model = getattr(qwen3_dflash, "DFlashQwen3Model", None)
    if model is None or not hasattr(model, "_normalize_context_k"):
        return  # a vLLM that no longer has it

    def normalize(self, all_k: torch.Tensor) -> torch.Tensor:  # [layers, positions, kv heads, head_dim]
        x = all_k.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self._rms_norm_eps)
        return (x * self._k_norm_weights[:, None, None, :].float()).to(all_k.dtype).contiguous()

    model._normalize_context_k = normalize


if __name__ == "__main__":
    fix_dflash_context_k_norm()
    sys.argv = [str(WORKER), *sys.argv[1:]]
    runpy.run_path(str(WORKER), run_name="__main__")
