"""`draftsmith check HEAD --target TARGET`: the gate and the doctor, a per-position table (or JSON), and exit
status 1 on a failed gate with a one-line diagnosis."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from draftsmith.acceptance_record import RECORD_FILE, Acceptance, carry_record, read_record, write_record
from draftsmith.errors import DraftsmithError
from draftsmith.methods import head_method, read_head_config, resolve_method, servable
from draftsmith.methods.formats import native as native_format
from draftsmith.methods.formats.checkpoint import SourceCheckpoint, local_directory
from draftsmith.methods.formats.registry import ReadContext, detect_source, exporter
from draftsmith.models.config import TargetConfig
from draftsmith.models.head_configs import HEAD_TYPE_KEY
from draftsmith.models.llama import CausalLM
from draftsmith.models.loader import load_target
from draftsmith.serve.check import doctor
from draftsmith.serve.check.calibration import calibration_prompts
from draftsmith.serve.check.gate import judge, measure, plain_llm

DEFAULT_K = 5
NOTED_MORE = 1.05  # a passing head's line names a reading that keeps this many times its drafts a step
DRAFT_MODEL = "draft_model"  # the method that serves a whole LM as the draft (PARD's with parallel_drafting)


def native_head(head: Path, target_dir: Path | None, workdir: Path) -> Path:
    """`head` itself when it is a native head or a draft model (a whole LM: PARD's, or any small one), else its
    native form (any format `convert` reads) in `workdir`."""
    config_path = head / "config.json"
    if config_path.is_file() and HEAD_TYPE_KEY in json.loads(config_path.read_text()):
        return head
    checkpoint = SourceCheckpoint(str(head))
    context = ReadContext(TargetConfig.from_model_dir(target_dir), str(target_dir)) if target_dir else ReadContext()
    try:
        source = detect_source(checkpoint)
    except DraftsmithError:
        if checkpoint.has("model.embed_tokens.weight") and "model_type" in checkpoint.config:
            return head  # no head layout: a draft model
        raise
    normalized = source.read(checkpoint, context)
    out = workdir / "native"
    native_format.write_atomically(exporter("native", normalized.head_type)(normalized), out, False)
    carry_record(checkpoint.directory, out)
    return out


def _target_dir(args: argparse.Namespace, head_dir: Path, config: dict) -> Path:
    if args.target:
        return Path(args.target)
    recorded = config.get("target_model") or ""
    found = local_directory(recorded, head_dir)
    if found is None:
        raise DraftsmithError(f"the head's target {recorded!r} is not a model directory here: pass --target TARGET_DIR")
    return found


def _spec(head_type: str, model: Path, k: int, config: dict) -> dict:
    spec = {"method": head_type, "model": str(model), "num_speculative_tokens": k}
    if "draft_dtype" in resolve_method(head_type).section.model_fields:  # a head type is its method's name
        spec["draft_dtype"] = "float32"  # the record's precision: a bfloat16 draft would blur the comparison
    # a head trained to draft in parallel (P-EAGLE) is checked so, and a PARD-adapted draft names its mask token
    if config.get("parallel_drafting") or (head_type == DRAFT_MODEL and "pard_token" in config):
        spec["parallel_drafting"] = True
    return spec


def _table(measured: Acceptance, record: Acceptance | None) -> str:
    lines = ["position  acceptance  record"]
    for i, rate in enumerate(measured.per_position):
        recorded = f"{record.per_position[i]:.3f}" if record and i < len(record.per_position) else "-"
        lines.append(f"{i + 1:>8}  {rate:>10.3f}  {recorded:>6}")
    lines.append(f"mean acceptance length {measured.mean_acceptance_length:.2f} at k={measured.k}")
    return "\n".join(lines)


def check_head(head_dir: Path, target_dir: Path, target: CausalLM, k: int | None = None, prompts: int = 4,
               max_tokens: int = 64, with_doctor: bool = True, name: str = "") -> dict:
    """The gate's result for the native head in `head_dir` on `target` (loaded from `target_dir`): {"head" (
    `name`, or the directory), "head_type", "k", "acceptance", "record", "failed" (one line, or None),
    "diagnosis", "readings"}."""
    config = json.loads((head_dir / "config.json").read_text())
    head_type, target_config = config.get(HEAD_TYPE_KEY, DRAFT_MODEL), TargetConfig.from_model_dir(target_dir)
    if head_type == DRAFT_MODEL:  # a whole LM: no head config to hold to the target, no convention to re-read
        k = k or min(DEFAULT_K, config.get("draftsmith_parallel_draft_tokens") or DEFAULT_K)
    else:
        if not servable(head_method(head_type)):
            raise DraftsmithError(f"{head_type} heads are not served by draftsmith, so they cannot be checked here")
        typed = read_head_config(config)
        typed.check_target(target_config)
        k = k or min(DEFAULT_K, typed.max_drafts() or DEFAULT_K)
    calibration = calibration_prompts(plain_llm(target_dir, target, prompts), prompts)

    def measured_at(directory: Path) -> Acceptance:
        return measure(target_dir, target, _spec(head_type, directory, k, config), calibration, max_tokens)

    measured, load_error, record = None, None, read_record(head_dir)
    try:
        measured = measured_at(head_dir)
    except DraftsmithError as exc:  # tensors its config does not name (an LM head it says it has, and lacks)
        load_error = str(exc)
    rereads = head_type != DRAFT_MODEL and (with_doctor or load_error)
    examined = doctor.examine(head_dir, config, measured_at, target_config.rope) if rereads else []
    diagnosis = doctor.diagnosis(measured, examined)
    # a slip can leave a head accepting well, just less than it should: a reading that accepts clearly more
    # fails the gate as surely as a record or the floor does
    failed = (f"does not load as written ({load_error})" if load_error else judge(measured, record)) or \
        (diagnosis and "is read under a convention it was not trained with")
    return {"head": name or str(head_dir), "head_type": head_type, "k": k,
            "acceptance": measured.to_json() if measured else None,
            "record": record.to_json() if record else None, "failed": failed, "diagnosis": diagnosis,
            "readings": [{"reading": r.what, "set": r.changes, "drafts_per_step": a.gain()} for r, a in examined]}


def verdict(result: dict) -> str:
    """The gate's one line."""
    if result["failed"]:
        return (f"FAILED: {result['head']} {result['failed']}"
                + (f"; {result['diagnosis']}" if result["diagnosis"] else "; no other reading accepts clearly more"))
    line = f"passed ({'against its record' if result['record'] else 'the floor, no record'})"
    written = Acceptance(**result["acceptance"]).gain()
    best = max(result["readings"], key=lambda r: r["drafts_per_step"], default=None)
    if best and best["drafts_per_step"] > NOTED_MORE * written:  # more, though not clearly: worth a look
        line += (f"; read with {best['reading']} it accepts {best['drafts_per_step']:.2f} drafts a step against "
                 f"{written:.2f}, short of clearly more")
    return line


def run(args: argparse.Namespace) -> int:
    head = Path(args.head)
    with tempfile.TemporaryDirectory(prefix="draftsmith-check-") as workdir:
        head_dir = native_head(head, Path(args.target) if args.target else None, Path(workdir))
        target_dir = _target_dir(args, head_dir, json.loads((head_dir / "config.json").read_text()))
        result = check_head(head_dir, target_dir, load_target(target_dir, dtype="float32"), args.k, args.prompts,
                            args.max_tokens, not args.no_doctor, str(head))
    measured = Acceptance(**result["acceptance"]) if result["acceptance"] else None
    if args.json:
        print(json.dumps(result, indent=2))
    elif measured:
        record = Acceptance(**result["record"]) if result["record"] else None
        print(_table(measured, record))
    say = sys.stderr if args.json else sys.stdout  # with --json, stdout is the JSON alone
    print(f"draftsmith check: {verdict(result)}", file=say)
    if result["failed"]:
        return 1
    if args.record:
        if head_dir != head:
            raise DraftsmithError(f"--record writes {RECORD_FILE} into a native head; convert {head} first")
        print(f"wrote {write_record(head, measured)}", file=say)
    return 0


def gate_served_head(spec_config, target_dir: Path, target: CausalLM) -> str | None:
    """`serve`'s gate at start on the head `spec_config` serves: its passing line, None where it serves no
    head (n-gram, a draft model), a DraftsmithError with the one line where it fails."""
    model = getattr(spec_config, "model", None)
    config_path = Path(model) / "config.json" if model else None
    if config_path is None or not config_path.is_file() or HEAD_TYPE_KEY not in json.loads(config_path.read_text()):
        return None
    model = Path(model)
    result = check_head(model, target_dir, target)
    if result["failed"]:
        raise DraftsmithError(f"acceptance gate {verdict(result)}; serve it anyway with --no-check")
    return f"acceptance gate {verdict(result)}: {result['head_type']} accepts " \
           f"{Acceptance(**result['acceptance']).gain():.2f} drafts a step at k={result['k']}"
