"""`make gpu-wheels`: the wheels the GPU image lacks, for Python 3.12 on x86-64, fetched here into `.whl/`.

The set is not a hand-kept list: it is draftsmith's own requirements, and those of its `dev` extra that the
tests collected on the GPU import (`TESTS_IMPORT`), followed through the metadata of what `make install` put in
this venv, stopping at every distribution the image holds (`draftsmith.gpu.image`). Each
is fetched at the version installed here, the one the tests pass with. After fetching, every wheel's own
Requires-Dist is checked against the wheels and the image, so a gap shows here rather than on the GPU.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import parse_wheel_filename
from packaging.version import Version

from draftsmith.gpu.image import KNOWN_VERSIONS, PYTHON, canonical, in_image
from draftsmith.gpu.runner import PY312_PLATFORM, WHEELS

# the GPU machine, as PEP 508 markers see it
TARGET_MARKERS = {"python_version": PYTHON, "python_full_version": f"{PYTHON}.3", "sys_platform": "linux",
                  "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
                  "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}
MANIFEST = "manifest.json"
# distributions of the `dev` extra that the GPU check's collected tests import (tests/unit and
# tests/integration/test_cuda_engine.py): pytest collects every module, so one missing import fails the check
TESTS_IMPORT = frozenset({"jsonschema"})


@dataclass(frozen=True)
class Needed:
    """What the GPU lacks: distribution -> the version installed here; and requirements the image's known
    versions do not meet."""

    wheels: dict[str, str]
    conflicts: list[str]


def applies(requirement: Requirement) -> bool:
    return requirement.marker is None or requirement.marker.evaluate(TARGET_MARKERS)


def image_conflict(requirement: Requirement) -> str | None:
    known = KNOWN_VERSIONS.get(canonical(requirement.name))
    if known and requirement.specifier and not requirement.specifier.contains(Version(known), prereleases=True):
        return f"{requirement} but the GPU image has {requirement.name} {known}"
    return None


def root_requirements(root: str = "draftsmith") -> list[Requirement]:
    """`root`'s run-time requirements, and those of its `dev` extra named in TESTS_IMPORT (without the marker)."""
    listed = [Requirement(text) for text in importlib.metadata.requires(root) or []]
    tests = [Requirement(str(r).split(";")[0]) for r in listed
             if r.marker is not None and r.marker.evaluate({**TARGET_MARKERS, "extra": "dev"})
             and canonical(r.name) in TESTS_IMPORT]
    return [r for r in listed if applies(r)] + tests


def needed_distributions(root: str = "draftsmith") -> Needed:
    """Walks `root`'s requirements (`root_requirements`) through this environment's installed metadata."""
    wheels: dict[str, str] = {}
    conflicts: list[str] = []
    pending = root_requirements(root)
    while pending:
        requirement = pending.pop()
        if not applies(requirement):
            continue
        name = canonical(requirement.name)
        if in_image(name):
            conflicts += filter(None, [image_conflict(requirement)])
            continue
        if name in wheels:
            continue
        try:
            version = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            raise SystemExit(f"gpu-wheels: {name} is needed on the GPU but not installed here: run `make install`") from None
        wheels[name] = version
        pending += [Requirement(text) for text in importlib.metadata.requires(name) or []]
    return Needed(dict(sorted(wheels.items())), conflicts)


def pip_download(wheels: dict[str, str], dest: Path) -> None:
    """Fetches exactly `wheels` (name -> version) as binary wheels for the GPU's Python and platform."""
    command = [sys.executable, "-m", "pip", "download", "-qq", "--no-deps", *PY312_PLATFORM, "--dest", str(dest),
               *(f"{name}=={version}" for name, version in wheels.items())]
    subprocess.run(command, check=True)


def wheel_files(dest: Path) -> dict[str, Path]:
    """The wheels in `dest` by canonical distribution name."""
    return {canonical(str(parse_wheel_filename(path.name)[0])): path for path in sorted(dest.glob("*.whl"))}


def prune(dest: Path, wheels: dict[str, str]) -> list[str]:
    """Deletes wheels in `dest` that are not the wanted version of a wanted distribution (two versions of one
    stop the whole install there); -> the names deleted."""
    removed = []
    for path in dest.glob("*.whl"):
        name, version, *_ = parse_wheel_filename(path.name)
        if wheels.get(canonical(str(name))) != str(version):
            path.unlink()
            removed.append(path.name)
    return removed


def wheel_requirements(path: Path) -> list[Requirement]:
    with zipfile.ZipFile(path) as archive:
        metadata = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        lines = archive.read(metadata).decode().splitlines()
    return [Requirement(line.split(":", 1)[1].strip()) for line in lines if line.startswith("Requires-Dist:")]


def unmet(dest: Path, roots: list[Requirement]) -> list[str]:
    """Requirements of `roots` and of every wheel in `dest` that neither a wheel there nor the image meets."""
    found = wheel_files(dest)
    versions = {name: Version(str(parse_wheel_filename(path.name)[1])) for name, path in found.items()}
    problems = []
    for owner, requirements in [("draftsmith", roots)] + [(n, wheel_requirements(p)) for n, p in found.items()]:
        for requirement in filter(applies, requirements):
            name = canonical(requirement.name)
            if name in versions:
                if not requirement.specifier.contains(versions[name], prereleases=True):
                    problems.append(f"{owner} needs {requirement}, the wheel is {versions[name]}")
            elif in_image(name):
                problems += filter(None, [image_conflict(requirement)])
            else:
                problems.append(f"{owner} needs {requirement}: neither carried nor in the GPU image")
    return problems


def fetch(dest: Path = WHEELS) -> dict:
    """Fetches, prunes and checks; -> the manifest written beside the wheels."""
    needed = needed_distributions()
    dest.mkdir(parents=True, exist_ok=True)
    pip_download(needed.wheels, dest)
    prune(dest, needed.wheels)
    missing = sorted(set(needed.wheels) - set(wheel_files(dest)))
    roots = root_requirements()
    problems = [f"{name}: no wheel fetched" for name in missing] + needed.conflicts + unmet(dest, roots)
    manifest = {"python": PYTHON, "wheels": {p.name: p.stat().st_size for p in sorted(dest.glob("*.whl"))},
                "bytes": sum(p.stat().st_size for p in dest.glob("*.whl")), "problems": sorted(set(problems))}
    (dest / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="make gpu-wheels", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dest", type=Path, default=WHEELS, help=f"folder for the wheels (default: {WHEELS}, or GPU_WHEELS)")
    args = parser.parse_args(argv)
    try:
        manifest = fetch(args.dest)
    except subprocess.CalledProcessError as exc:
        print(f"gpu-wheels: pip download failed (exit {exc.returncode}); see its message above", file=sys.stderr)
        return 1
    for name, size in manifest["wheels"].items():
        print(f"  {size / 2**20:6.2f} MiB  {name}")
    print(f"gpu-wheels: {len(manifest['wheels'])} wheels, {manifest['bytes'] / 2**20:.1f} MiB in {args.dest}/")
    for problem in manifest["problems"]:
        print(f"gpu-wheels: {problem}", file=sys.stderr)
    return 1 if manifest["problems"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
