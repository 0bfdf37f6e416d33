"""The gate: a head's greedy acceptance per draft position at a fixed k on calibration prompts, judged
against the head's record (`draftsmith.acceptance_record`: what its training eval or an earlier check
measured) or, without one, against a floor that only a head read right clears."""

from __future__ import annotations

from pathlib import Path

from draftsmith.acceptance_record import RECORD_FILE, Acceptance
from draftsmith.models.llama import CausalLM
from draftsmith.serve.apps.llm import LLM
from draftsmith.serve.engine.sampling_params import SamplingParams

# a head passes its record when it keeps this share of the record's gain (mean acceptance length - 1) at the
# same k. A record `check` wrote was measured as the gate measures, so only numerics move it; a training
# record is simulated, teacher-forced, on the eval split rather than served on calibration text
RECORD_SHARE = {"check": 0.8, "training": 0.5}
# without a record: the first draft position must be accepted this often. Heads read right accept 0.2-0.8
# there on text their target wrote; mis-read ones (an MTP input concatenated the wrong way) a few percent
FLOOR = 0.1
MAX_MODEL_LEN = 512  # calibration prompt, output and drafts: a small KV cache, whatever the target's context


def plain_llm(target_dir: Path, target: CausalLM, max_num_seqs: int, spec: dict | None = None) -> LLM:
    """An engine over the loaded `target`, on its device and in its dtype."""
    weight = target.model.embed_tokens.weight
    return LLM(target_dir, dtype=weight.dtype, device=str(weight.device), speculative_config=spec,
               max_num_seqs=max_num_seqs, max_model_len=min(MAX_MODEL_LEN, target.config.max_position_embeddings),
               target=target)


def measure(target_dir: Path, target: CausalLM, spec: dict, prompts: list[list[int]], max_tokens: int) -> Acceptance:
    """Greedy decoding of `prompts` with `spec` (vLLM's keys) at its fixed k."""
    k = spec["num_speculative_tokens"]
    llm = plain_llm(target_dir, target, len(prompts), {**spec, "adaptive": False})
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
    metrics = llm.get_metrics()
    drafted = metrics["drafted_per_position"]
    rates = [a / d if d else 0.0 for a, d in zip(metrics["accepted_per_position"], drafted)]
    return Acceptance(k, metrics["mean_acceptance_length"], rates[:k], "check",
                      f"{len(prompts)} calibration prompts the target wrote, {max_tokens} tokens each, greedy")


def judge(measured: Acceptance, record: Acceptance | None) -> str | None:
    """Why `measured` fails the gate, in one line, or None when it passes."""
    if record is not None:
        k, share = min(measured.k, record.k), RECORD_SHARE[record.source]
        if measured.gain(k) < share * record.gain(k):
            return (f"accepts {measured.gain(k):.2f} drafts a step at k={k} where its {RECORD_FILE} record "
                    f"({record.source}) has {record.gain(k):.2f}: below {share:.0%} of it")
        return None
    if measured.per_position[0] < FLOOR:
        return (f"accepts its first draft {measured.per_position[0]:.1%} of the time, below the floor of {FLOOR:.0%} "
                f"a head read right clears (no {RECORD_FILE} record to compare with)")
    return None
