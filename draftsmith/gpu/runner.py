"""How the scripts run on a lent GPU machine (`make gpu-check`, `make gpu-train`): the carried wheels and
draftsmith installed into a site folder put first on every subprocess's path, subprocesses with a share of a
time budget, one log, results as plain records.

Standard library only: this runs before draftsmith is importable (`python3 -m draftsmith.gpu.check` from the
repository root finds this folder, not the installed package).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from draftsmith.gpu.image import PLATFORMS, PYTHON

REPO = Path(__file__).resolve().parents[2]
WHEELS = Path(os.environ.get("GPU_WHEELS") or REPO / ".whl")  # what `make gpu-wheels` fetched
PY312_PLATFORM = ["--python-version", PYTHON, "--implementation", "cp", "--only-binary=:all:",
                  *(arg for platform in PLATFORMS for arg in ("--platform", platform))]


@dataclass
class Result:
    name: str
    status: str  # "pass", "fail", "timeout" or "skipped: <why>"
    seconds: float = 0.0
    detail: str = ""
    figures: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Setup:
    """Where the check runs: the output folder, the installed site, whether dry, the environment every
    subprocess gets, when the time budget ends."""

    out: Path
    site: Path
    dry: bool
    env: dict
    deadline: float

    def seconds_left(self, wanted: float) -> float:
        return max(1.0, min(wanted, self.deadline - time.monotonic()))


def run(command: list[str], setup: Setup, timeout: float, step: str) -> tuple[int | None, str]:
    """Runs `command` in the repository root; -> (exit status, None on timeout; its output's tail). The
    whole output is appended to OUT/log.txt under `step`'s heading (few files: OUT travels back, 8 at most)."""
    try:
        done = subprocess.run(command, cwd=REPO, env=setup.env, capture_output=True, text=True,
                              timeout=setup.seconds_left(timeout))
        code, text = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as exc:
        code = None
        text = "".join(part.decode(errors="replace") if isinstance(part, bytes) else part or ""
                       for part in (exc.stdout, exc.stderr))
    with (setup.out / "log.txt").open("a") as log:
        log.write(f"===== {step}: {' '.join(command)[:300]}\n{text}\n")
    return code, text[-2000:]


def timed(name: str, body, *args) -> Result:
    start = time.monotonic()
    try:
        result = body(*args)
    except Exception as exc:  # a broken check is reported, and the next one runs
        result = Result(name, "fail", detail=f"{type(exc).__name__}: {exc}")
    result.seconds = round(time.monotonic() - start, 1)
    return result


def install(setup: Setup) -> Result:
    """The carried wheels and draftsmith into the site folder, first on every subprocess's path. Dry: the
    wheels are installed for Python 3.12 into a folder of their own (proving they install, not importable
    here)."""
    site = setup.site
    wheels = sorted(str(p) for p in WHEELS.glob("*.whl"))
    if not wheels:
        return Result("install", "fail", detail=f"no wheels in {WHEELS}: run `make gpu-wheels` on the CPU machine")
    pip = [sys.executable, "-m", "pip", "install", "-qq", "--no-index", "--no-deps", "--no-compile",
           "--no-cache-dir", "--upgrade"]
    wheel_target = ["--target", f"{site}-py312", *PY312_PLATFORM] if setup.dry else ["--target", str(site)]
    code, tail = run(pip + wheel_target + wheels, setup, 120, "install the carried wheels")
    if code != 0:
        return Result("install", "fail", detail=f"the carried wheels did not install: {tail}")
    copy_sources(site)
    return Result("install", "pass", detail=f"{len(wheels)} wheels and draftsmith into {site}")


def copy_sources(site: Path) -> None:
    """draftsmith from the tree into `site`, laid out as its wheel would be (pyproject's package-dir mapping:
    models/ becomes draftsmith/models), without building it: the image needs no build backend, and the copy
    is never older than the tree."""
    import tomllib

    mapping = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    shutil.rmtree(site / "draftsmith", ignore_errors=True)
    for package, folder in sorted(mapping.items()):  # the root package before the folders mapped into it
        shutil.copytree(REPO / folder, site.joinpath(*package.split(".")), dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))


def report(script: str, setup: Setup, results: list[Result], **extra) -> int:
    """Writes OUT/summary.json (every result, which failed or timed out, `extra`) and prints its last line;
    -> the exit status: 1 if any failed."""
    failed = [r.name for r in results if r.status in ("fail", "timeout")]
    summary = {**extra, "dry": setup.dry, "passed": not failed, "failed": failed, "checks": [asdict(r) for r in results]}
    (setup.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"{script}: {'passed' if not failed else 'FAILED: ' + ', '.join(failed)}; summary in "
          f"{setup.out / 'summary.json'}")
    return 1 if failed else 0


def make_setup(environ: dict, name: str, default_budget_s: float) -> Setup:
    """The setup of the script `name` (gpu-check, gpu-train): its output in OUT (else build/NAME), dry when
    NAME_DRY=1 (GPU_CHECK_DRY), its time budget NAME_BUDGET_S; the site is build/gpu-site (GPU_SITE)."""
    variable = name.upper().replace("-", "_")
    out = Path(environ.get("OUT") or REPO / "build" / name).resolve()
    out.mkdir(parents=True, exist_ok=True)
    (out / "log.txt").unlink(missing_ok=True)
    site = Path(environ.get("GPU_SITE") or REPO / "build" / "gpu-site").resolve()  # not under OUT: it travels back
    dry = environ.get(f"{variable}_DRY") == "1"
    env = {k: v for k, v in environ.items() if k != "TRITON_INTERPRET"}  # the interpreter would prove nothing
    # PYTHONSAFEPATH: `python -m` run from the repository root must not import its draftsmith/ folder, which
    # holds only part of the package (models/, serve/... are mapped into it when installed)
    env.update(PYTHONPATH=os.pathsep.join(filter(None, [str(site), environ.get("PYTHONPATH")])), PYTHONUNBUFFERED="1",
               PYTHONSAFEPATH="1")
    if not dry:
        env["DRAFTSMITH_GPU_CHECK"] = "1"  # tests/conftest.py: no CUDA, or the interpreter, fails the session
    budget = float(environ.get(f"{variable}_BUDGET_S", default_budget_s))
    return Setup(out, site, dry, env, time.monotonic() + budget)


def cuda_available(setup: Setup) -> bool:
    if setup.dry:
        return False
    probe = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.is_available())"],
                           capture_output=True, text=True, env=setup.env)
    return probe.stdout.strip() == "True"


def travelling_bytes() -> int:
    """What every device call carries anyway: tracked files and untracked ones git does not ignore."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            capture_output=True, check=True).stdout.split(b"\0")
    return sum((REPO / os.fsdecode(name)).stat().st_size for name in listed if name and (REPO / os.fsdecode(name)).is_file())
