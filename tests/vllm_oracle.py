"""vLLM's CPU build as an independent oracle for `draftsmith convert --to vllm`: each shipped demo head is
exported with draftsmith's converter, served by vLLM (its own venv, build/peer-vllm: `make peer-vllm`; the
worker of `draftsmith bench --peer vllm`) and by draftsmith on the same prompts, greedy, a fixed k, one request
in flight; the two per-position acceptance rates are then compared. Exports vLLM cannot serve must say so.

The prompts are Python standard-library source: code the demo heads never trained on, the same on every
machine with this Python. Run as a script, it prints the README's table:

    .venv/bin/python tests/vllm_oracle.py
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from draftsmith.serve.bench.peer import WORKER as BENCH_WORKER
from draftsmith.vllm_process import DEFAULT_PYTHON as PEER_PYTHON

REPO = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).with_name("vllm_oracle_worker.py")
INSTALLED = PEER_PYTHON.parent.parent / ".vllm-installed"  # the Makefile's PEER_STAMP: vLLM installed whole
TARGET = REPO / "assets" / "demo-code-7m"
PROMPT_MODULES = ("json.decoder", "argparse", "textwrap", "shlex", "string", "fractions")
PROMPT_CHARS = 1500
MAX_TOKENS = 64
THREADS = 2

# row name -> draftsmith's speculative config of a shipped head (k as `make bench` runs it). Both engines
# draft in float32, as vLLM runs a float32 model's heads: the oracle checks how a head is read, not bfloat16
FP32 = {"draft_dtype": "float32"}
HEADS = {
    "eagle": {"method": "eagle", "model": "assets/demo-code-7m-eagle", "num_speculative_tokens": 3, **FP32},
    "eagle3": {"method": "eagle3", "model": "assets/demo-code-7m-eagle3", "num_speculative_tokens": 5, **FP32},
    "dflash": {"method": "dflash", "model": "assets/demo-code-7m-dflash", "num_speculative_tokens": 8, **FP32},
    "medusa": {"method": "medusa", "model": "assets/demo-code-7m-medusa", "num_speculative_tokens": 3},
    "pard": {"method": "draft_model", "model": "assets/demo-code-7m-pard", "num_speculative_tokens": 6,
             "parallel_drafting": True, **FP32},
    "draft_model": {"method": "draft_model", "model": "assets/demo-code-7m", "num_speculative_tokens": 4, **FP32},
    "mtp": {"method": "mtp", "model": "assets/demo-code-7m-mtp", "num_speculative_tokens": 1, **FP32},
    # heads no asset holds (the tracked tree's budget), written on first use (`built_heads`): a random DSpark
    # head, and the shipped EAGLE-3 head made P-EAGLE (its first draft trained, its slots random)
    "dspark": {"method": "dspark", "model": "build/oracle-heads/dspark", "num_speculative_tokens": 5,
               "enable_adaptive_verification": False, **FP32},
    "peagle": {"method": "eagle3", "model": "build/oracle-heads/peagle", "num_speculative_tokens": 5,
               "parallel_drafting": True, **FP32},
    # the same with a second decoder layer (vLLM's num_hidden_layers), random and small
    "peagle-2-layers": {"method": "eagle3", "model": "build/oracle-heads/peagle-2-layers",
                        "num_speculative_tokens": 5, "parallel_drafting": True, **FP32},
    # the same with a window far shorter than the prompts (as recipes/eagle3-parallel-demo.yaml trains one):
    # vLLM must slide it as draftsmith does, or the first draft's acceptance parts
    "peagle-window": {"method": "eagle3", "model": "build/oracle-heads/peagle-window",
                      "num_speculative_tokens": 5, "parallel_drafting": True, **FP32},
    # the shipped DFlash head with a window far shorter than the prompts (its own, 256, is about as long): each
    # block position's window must end at its own position in vLLM as in draftsmith
    "dflash-window": {"method": "dflash", "model": "build/oracle-heads/dflash-window", "num_speculative_tokens": 8,
                      **FP32},
    # the shipped EAGLE-1 head with a window far shorter than the prompts: vLLM's llama_eagle reads layer_types
    # at its layer's number after the target's, and must slide it as draftsmith does
    "eagle-window": {"method": "eagle", "model": "build/oracle-heads/eagle-window", "num_speculative_tokens": 3,
                     **FP32},
}


def built_heads() -> None:
    """Writes the heads of HEADS that no asset holds, where their configs name them."""
    import sys

    if str(Path(__file__).parent) not in sys.path:
        sys.path.insert(0, str(Path(__file__).parent))
    from draftsmith.models import load_target
    from helpers import dspark_head, peagle_head

    if not (REPO / HEADS["dspark"]["model"] / "config.json").is_file():
        dspark_head(load_target(TARGET, dtype="float32"), REPO / HEADS["dspark"]["model"])
    if not (REPO / HEADS["peagle"]["model"] / "config.json").is_file():
        peagle_head(REPO / HEADS["peagle"]["model"])
    if not (REPO / HEADS["peagle-2-layers"]["model"] / "config.json").is_file():
        peagle_head(REPO / HEADS["peagle-2-layers"]["model"], layers=2)
    if not (REPO / HEADS["peagle-window"]["model"] / "config.json").is_file():
        peagle_head(REPO / HEADS["peagle-window"]["model"], layers=2, window=16)
    if not (REPO / HEADS["dflash-window"]["model"] / "config.json").is_file():
        _windowed_copy(REPO / HEADS["dflash"]["model"], REPO / HEADS["dflash-window"]["model"], 16)
    if not (REPO / HEADS["eagle-window"]["model"] / "config.json").is_file():
        _windowed_copy(REPO / HEADS["eagle"]["model"], REPO / HEADS["eagle-window"]["model"], 16)


def _windowed_copy(head: Path, directory: Path, window: int) -> None:
    """A copy of a head's directory with its `sliding_window` set to `window`."""
    shutil.copytree(head, directory)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "sliding_window": window}, indent=2))


@dataclass
class OracleRun:
    """One engine's greedy acceptance: mean acceptance length and the rate each draft position was accepted."""

    mean: float | None = None
    per_position: list[float] = field(default_factory=list)
    outputs: list[list[int]] = field(default_factory=list)
    refused: str | None = None  # vLLM's one-line reason where it would not serve the export
    export_notes: list[str] = field(default_factory=list)


def prompts() -> list[list[int]]:
    from draftsmith.models.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(TARGET)
    return [tokenizer.encode(inspect.getsource(importlib.import_module(name))[:PROMPT_CHARS])
            for name in PROMPT_MODULES]


def draftsmith_acceptance(spec: dict, prompt_ids: list[list[int]]) -> OracleRun:
    from draftsmith.serve.apps.llm import LLM
    from draftsmith.serve.engine.sampling_params import SamplingParams

    spec = {**spec, "model": str(REPO / spec["model"]), "adaptive": False}
    llm = LLM(str(TARGET), dtype="float32", speculative_config=spec, max_num_seqs=1)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params, use_tqdm=False)
    metrics = llm.get_metrics()
    rates = [a / d for a, d in zip(metrics["accepted_per_position"], metrics["drafted_per_position"]) if d]
    return OracleRun(metrics["mean_acceptance_length"], rates, [list(o.outputs[0].token_ids) for o in outputs])


def vllm_acceptance(name: str, spec: dict, prompt_ids: list[list[int]], python: Path, workdir: Path,
                    fixed: bool = True) -> OracleRun:
    """The export's acceptance in vLLM, through the bench's peer worker (c = 1, greedy, `MAX_TOKENS` each);
    `fixed`: with vLLM's CPU defects fixed (tests/vllm_oracle_worker.py), else vLLM as it is shipped."""
    import contextlib
    import io

    from draftsmith.serve.bench.peer import make_job, vllm_config
    from draftsmith.vllm_process import PeerWorker

    said = io.StringIO()
    with contextlib.redirect_stdout(said):  # the converter's report; its notes are kept
        config = vllm_config(name, {**spec, "model": str(REPO / spec["model"])}, TARGET, workdir)
    notes = [line.strip().removeprefix("note: ") for line in said.getvalue().splitlines() if "note:" in line]
    if isinstance(config, str):
        return OracleRun(refused=config, export_notes=notes)
    job = make_job(TARGET, {1: prompt_ids}, MAX_TOKENS, config)
    worker = PeerWorker(python, job, f"0-{THREADS - 1}", THREADS, workdir, worker=WORKER if fixed else BENCH_WORKER)
    try:
        ready = worker.reply()
        if "refused" in ready:
            return OracleRun(refused=ready["refused"], export_notes=notes)
        result = worker.round(1)["round"]
    finally:
        worker.close()
    return OracleRun(result["mean_acceptance_length"], result["acceptance_per_position"], result["outputs"],
                      export_notes=notes)


def compare(name: str, python: Path) -> tuple[OracleRun, OracleRun]:
    """(draftsmith's, vLLM's) acceptance of the shipped head `name` on the oracle's prompts."""
    built_heads()
    prompt_ids = prompts()
    ours = draftsmith_acceptance(HEADS[name], prompt_ids)
    with tempfile.TemporaryDirectory() as workdir:
        theirs = vllm_acceptance(name, HEADS[name], prompt_ids, python, Path(workdir))
    return ours, theirs


def table_row(name: str, ours: OracleRun, theirs: OracleRun) -> str:
    k = HEADS[name]["num_speculative_tokens"]
    if theirs.refused:
        return f"| {name} | {k} | {ours.mean:.2f} | - | not served by vLLM: {theirs.refused} |"
    rates = " / ".join(f"{a:.2f}:{b:.2f}" for a, b in zip(ours.per_position, theirs.per_position))
    return f"| {name} | {k} | {ours.mean:.2f} | {theirs.mean:.2f} | {rates} |"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--python", default=str(PEER_PYTHON), help="the vLLM venv's python")
    parser.add_argument("heads", nargs="*", default=list(HEADS), help=f"rows to run (default: {' '.join(HEADS)})")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(THREADS)
    print("| head | k | draftsmith acceptance | vLLM acceptance | per position, draftsmith:vLLM |")
    print("|---|---|---|---|---|")
    for name in args.heads:
        print(table_row(name, *compare(name, Path(args.python))), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
