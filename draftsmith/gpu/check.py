"""`make gpu-check`: one short run on a lent GPU proving the Triton kernels, the graph-captured steps and the
8B-shape speed, with one JSON summary (`OUT`, else build/gpu-check/) and a table.

Run with the machine's own python3, from the repository root, after `make gpu-wheels` here carried `.whl/`:
the carried wheels and draftsmith itself are installed into a folder put first on the path, then each check
runs as a subprocess with a share of the time budget (`GPU_CHECK_BUDGET_S`, 360 s). A check that fails or runs
out of time is reported and the next one runs. `GPU_CHECK_DRY=1` runs it all on a CPU: the CUDA checks report
"skipped: no CUDA" after collecting their tests, the bench runs the `tiny` shape.

Standard library only (with `draftsmith.gpu.runner`): it runs before draftsmith is installed.
"""

from __future__ import annotations

import json
import os
import platform
import re
import sys
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path

from draftsmith.gpu.runner import Result, Setup, cuda_available, install, make_setup, report, run, timed

# the figures to hold ours against (../shared/docs/anchors.md, issue #37): Llama-3.1-8B bf16 at batch 1, H100
ANCHORS_MS = {"gpt-fast": 7.0, "weights / HBM floor": 5.3}
KERNEL_TESTS = ["tests/unit"]
ENGINE_TESTS = ["tests/integration/test_cuda_engine.py"]


ENVIRONMENT = """
import json, subprocess, torch, triton, transformers, draftsmith.cli, draftsmith.serve.openai.app
try:
    driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                            capture_output=True, text=True, timeout=20).stdout.strip()
except (OSError, subprocess.SubprocessError):
    driver = None
cuda = torch.cuda.is_available()
print(json.dumps({"torch": torch.__version__, "triton": triton.__version__, "transformers": transformers.__version__,
                  "cuda": torch.version.cuda, "device": torch.cuda.get_device_name() if cuda else "cpu",
                  "driver": driver or None, "cuda_available": cuda, "draftsmith": draftsmith.cli.__file__}))
"""


def environment(setup: Setup) -> Result:
    """Imports the engine and the server from the installed copy; -> versions, device and driver."""
    code, tail = run([sys.executable, "-c", ENVIRONMENT], setup, 120, "environment")
    if code != 0:
        return Result("environment", "fail", detail=tail)
    versions = json.loads(tail.strip().splitlines()[-1])
    versions["python"] = platform.python_version()
    return Result("environment", "pass", figures=versions)


def pytest_check(name: str, paths: list[str], setup: Setup, cuda: bool, timeout: float) -> Result:
    """The `cuda`-marked tests under `paths`, on CUDA; without CUDA only collected (how many would run)."""
    base = [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider", *paths]
    if not cuda:
        code, tail = run(base + ["--collect-only"], setup, 120, name)
        collected = re.search(r"(\d+)(?:/\d+)? tests? collected", tail)
        count = int(collected.group(1)) if collected else 0
        if code != 0 or not count:
            return Result(name, "fail", detail=f"collecting the cuda tests failed: {tail}")
        return Result(name, "skipped: no CUDA", detail=f"{count} tests collected", figures={"collected": count})
    report = setup.out / f"{name}.xml"
    code, tail = run(base + ["--timeout", "120", f"--junitxml={report}"], setup, timeout, name)
    figures = junit_counts(report) if report.is_file() else {}
    if code is None:
        return Result(name, "timeout", detail=tail, figures=figures)
    return Result(name, "pass" if code == 0 else "fail", detail="" if code == 0 else tail, figures=figures)


def junit_counts(report: Path) -> dict:
    """Tests run, failed and skipped from a JUnit XML report, and the failures by name with their message."""
    cases = ElementTree.parse(report).getroot().iter("testcase")
    counts, failed = {"tests": 0, "failed": 0, "skipped": 0}, {}
    for case in cases:
        counts["tests"] += 1
        for kind in ("failure", "error"):
            for problem in case.iter(kind):
                failed[f"{case.get('classname')}::{case.get('name')}"] = (problem.get("message") or "")[:300]
        counts["skipped"] += any(True for _ in case.iter("skipped"))
    return {**counts, "failed": len(failed), "failures": failed}


def bench(setup: Setup, cuda: bool, timeout: float) -> Result:
    """`draftsmith bench --shape`: Llama-3.1-8B in bf16 on CUDA (batch 1, 4, 16; plain and a random EAGLE-3
    head at synthetic acceptance 0.6 and 0.8; the verify-cost curve; eager and CUDA graphs), `tiny` on CPU."""
    report = setup.out / "bench.json"
    if cuda:
        shape = ["--shape", "llama-3.1-8b", "--dtype", "bfloat16", "--concurrency", "1,4,16", "--max-tokens", "64",
                 "--num-prompts", "4", "--waves", "1"]
    else:
        shape = ["--shape", "tiny", "--device", "cpu", "--concurrency", "1,4", "--max-tokens", "16",
                 "--num-prompts", "2", "--waves", "1"]
    command = [sys.executable, "-m", "draftsmith", "bench", *shape, "--random-weights", "--no-plot",
               "--json", str(report)]
    code, tail = run(command, setup, timeout, "bench")
    if code != 0 or not report.is_file():
        return Result("bench", "timeout" if code is None else "fail", detail=tail)
    figures = json.loads(report.read_text())
    return Result("bench", "pass", detail=" ".join(shape[:2]), figures=figures)


def checks(setup: Setup, cuda: bool) -> list[Result]:
    results = [timed("install", install, setup)]
    if results[0].status != "pass":
        return results
    results.append(timed("environment", environment, setup))
    results.append(timed("kernels-and-steps", pytest_check, "kernels-and-steps", KERNEL_TESTS, setup, cuda, 140))
    results.append(timed("greedy-equality", pytest_check, "greedy-equality", ENGINE_TESTS, setup, cuda, 70))
    results.append(timed("bench", bench, setup, cuda, 130))
    return results


def table(results: list[Result]) -> str:
    """A short table: one line a check, then the bench's ms/token by batch and the verify-cost curves."""
    lines = [f"{r.name:18s} {r.status:24s} {r.seconds:6.1f} s  {r.detail.splitlines()[-1] if r.detail else ''}"[:150]
             for r in results]
    for r in results:
        for test, message in r.figures.get("failures", {}).items():
            lines.append(f"  FAILED {test}: {message.splitlines()[0] if message else ''}"[:150])
    bench_figures = next((r.figures for r in results if r.name == "bench" and r.status == "pass"), None)
    if bench_figures:
        lines.append(f"bench {bench_figures['shape']} on {bench_figures['device']}: ms per token of one request")
        for row in bench_figures["rows"]:
            accepted = f"  acceptance {row['acceptance_length']:.2f}" if row.get("acceptance_length") else ""
            lines.append(f"  batch {row['batch']:3d}  {row['method']:40s} {row['ms_per_token']:8.2f} ms  "
                         f"{row['speedup']:5.2f}x{accepted}")
        for mode, curve in bench_figures.get("step_modes", {}).items():
            ratios = " ".join(f"k={k}:{v:.2f}" for k, v in curve["verify_ratio"].items())
            lines.append(f"  verify cost, {mode}: decode {curve['decode_ms']:.2f} ms; {ratios}")
        lines.append("  anchors (8B bf16, batch 1, H100): " + ", ".join(f"{k} {v} ms" for k, v in ANCHORS_MS.items()))
    return "\n".join(lines)


def main() -> int:
    setup = make_setup(dict(os.environ), "gpu-check", 360)
    cuda = cuda_available(setup)
    if not setup.dry and not cuda:
        print("gpu-check: no CUDA device here; GPU_CHECK_DRY=1 runs the dry mode on a CPU", file=sys.stderr)
        return 2
    started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    results = checks(setup, cuda)
    print(table(results))
    return report("gpu-check", setup, results, started=started)

if __name__ == "__main__":
    raise SystemExit(main())
