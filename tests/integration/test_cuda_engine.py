"""The engine on a GPU end to end (`make gpu-check`): greedy decoding of the demo model while speculating with
n-gram, EAGLE-3, DFlash and a static EAGLE-3 tree, with eager steps and with captured CUDA graphs, gives the
tokens plain eager decoding gives on the same GPU, and drafts while it does. Without CUDA every test is
collected and skipped."""

import pytest
import torch

from draftsmith.serve import LLM
from helpers import DEMO_MODEL, greedy_token_ids, spec_config

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(),
                                                   reason="needs a CUDA device: `make gpu-check` runs it on a GPU")]

EAGLE3_HEAD = DEMO_MODEL.parent / "demo-code-7m-eagle3"
DFLASH_HEAD = DEMO_MODEL.parent / "demo-code-7m-dflash"
# 9 nodes, 4 deep: three candidates at the first draft, fewer after (tests/unit/test_eagle_tree.py's)
STATIC_TREE = "[(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 1, 0), (0, 0, 0, 0)]"
# adaptive off: the cost model of a fast GPU could keep every step plain, and these runs must draft
SPECULATION = {
    "ngram": spec_config("ngram", k=4, prompt_lookup_max=4, prompt_lookup_min=2),
    "eagle3": spec_config("eagle3", EAGLE3_HEAD, 4),
    "dflash": spec_config("dflash", DFLASH_HEAD, 8),
    # a static tree is verified whole: adaptive is off by itself
    "eagle3-tree": {"method": "eagle3", "model": str(EAGLE3_HEAD), "num_speculative_tokens": 9,
                    "speculative_token_tree": STATIC_TREE},
}


@pytest.mark.parametrize("step_mode", ["eager", "cuda-graph"])
@pytest.mark.parametrize("method", list(SPECULATION))
def test_speculation_decodes_what_plain_eager_decoding_does(kernel_target, kernel_greedy_reference, method,
                                                           step_mode):
    """A mixed batch (4 prompts through 3 slots, rows joining and leaving) in float32, through the Triton
    kernels the engine picks on CUDA (slot attention, greedy draft picks): the same greedy token ids as plain
    decoding with eager steps and PyTorch's attention (`kernel_greedy_reference`)."""
    llm = LLM(DEMO_MODEL, dtype="float32", device="cuda", max_num_seqs=3, max_model_len=256, target=kernel_target,
              speculative_config=SPECULATION[method], step_mode=step_mode)
    assert llm.engine.step_mode == step_mode
    assert greedy_token_ids(llm) == kernel_greedy_reference
    assert llm.get_metrics()["num_draft_tokens"] > 0
