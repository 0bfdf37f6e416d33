"""The GPU tools' pieces on the CPU: which wheels travel, how a gap in them shows, and how the check reads a
JUnit report."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

from packaging.requirements import Requirement

from draftsmith.gpu import check, wheels
from draftsmith.gpu.image import in_image


def test_the_wheels_are_what_the_image_lacks_at_the_versions_installed_here():
    import importlib.metadata

    needed = wheels.needed_distributions()
    for name in ("pydantic", "pydantic-core", "fastapi", "starlette", "uvicorn", "openai", "datasets"):
        assert needed.wheels[name] == importlib.metadata.version(name)
    assert not any(in_image(name) for name in needed.wheels)  # torch, transformers, triton... stay behind
    assert "torch" not in needed.wheels and not needed.conflicts


def test_a_requirement_the_images_known_version_fails_is_a_conflict():
    assert wheels.image_conflict(Requirement("torch>=2.12")) == "torch>=2.12 but the GPU image has torch 2.11.0"
    assert wheels.image_conflict(Requirement("torch>=2.5")) is None
    assert wheels.image_conflict(Requirement("pyarrow>=99")) is None  # a version nobody read: trusted


def _wheel(folder: Path, name: str, version: str, requires: list[str]) -> Path:
    path = folder / f"{name}-{version}-py3-none-any.whl"
    metadata = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n" + "".join(
        f"Requires-Dist: {r}\n" for r in requires)
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(f"{name}-{version}.dist-info/METADATA", metadata)
    return path


def test_a_gap_in_the_wheels_shows_here(tmp_path):
    _wheel(tmp_path, "alpha", "1.0", ["beta>=2", "torch>=2.5", "gamma", "delta; python_version < '3.8'",
                                      "epsilon; extra == 'docs'"])
    _wheel(tmp_path, "beta", "1.5", [])
    problems = wheels.unmet(tmp_path, [Requirement("alpha")])
    assert problems == ["alpha needs beta>=2, the wheel is 1.5", "alpha needs gamma: neither carried nor in the GPU image"]


def test_prune_keeps_one_version_of_each(tmp_path):
    _wheel(tmp_path, "alpha", "1.0", [])
    _wheel(tmp_path, "alpha", "0.9", [])
    _wheel(tmp_path, "stale", "3.0", [])
    assert sorted(wheels.prune(tmp_path, {"alpha": "1.0"})) == ["alpha-0.9-py3-none-any.whl",
                                                               "stale-3.0-py3-none-any.whl"]
    assert [p.name for p in tmp_path.glob("*.whl")] == ["alpha-1.0-py3-none-any.whl"]


def test_the_check_reads_failures_from_a_junit_report(tmp_path):
    report = tmp_path / "r.xml"
    report.write_text('<testsuites><testsuite><testcase classname="tests.unit.test_a" name="test_ok"/>'
                      '<testcase classname="tests.unit.test_a" name="test_bad"><failure message="assert 1 == 2">'
                      'trace</failure></testcase><testcase classname="t" name="test_skip"><skipped/></testcase>'
                      '</testsuite></testsuites>')
    counts = check.junit_counts(report)
    assert counts == {"tests": 3, "failed": 1, "skipped": 1,
                      "failures": {"tests.unit.test_a::test_bad": "assert 1 == 2"}}
    results = [check.Result("kernels-and-steps", "fail", 3.0, "1 failed", counts)]
    assert "FAILED tests.unit.test_a::test_bad: assert 1 == 2" in check.table(results)
    assert json.loads(json.dumps(counts)) == counts  # goes into summary.json as it is
