"""The GPU tools' pieces on the CPU: which wheels travel, how a gap in them shows, how ../shared's inputs go
over in parts and come back whole, and how the check reads a JUnit report."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from draftsmith.gpu import check, train, wheels
from draftsmith.gpu.image import canonical, in_image


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


@pytest.fixture
def inputs(tmp_path):
    """Files beside a repository, as ../shared is: a model folder and a corpus."""
    base = tmp_path / "work"
    model = base / "shared" / "models" / "m"
    model.mkdir(parents=True)
    (model / "config.json").write_text('{"hidden_size": 8}')
    (model / "model.safetensors").write_bytes(bytes(range(256)) * 1200)
    (base / "shared" / "data.jsonl.xz").write_bytes(b"corpus" * 40000)
    return base, sorted(p for p in base.rglob("*") if p.is_file())


def test_inputs_go_over_in_parts_and_come_back_whole(tmp_path, inputs):
    base, files = inputs
    parts = train.pack(files, 50_000, 120_000, tmp_path / "carry", base)
    sizes = [(p / "data.bin").stat().st_size for p in parts]
    assert sizes[0] == 50_000 and all(s <= 120_000 for s in sizes) and sum(sizes) == sum(f.stat().st_size for f in files)
    received = tmp_path / "received"
    for part in parts:  # one device call a part
        (tmp_path / "call").mkdir()
        part.rename(tmp_path / "call" / part.name)
        assert train.receive(tmp_path / "call", received) == 0
        (tmp_path / "call").rmdir()
    result = train.join(received, tmp_path / "joined")
    assert result.status == "pass", result.detail
    for path in files:
        assert (tmp_path / "joined" / path.relative_to(base)).read_bytes() == path.read_bytes()


def test_a_missing_or_damaged_part_is_named(tmp_path, inputs):
    base, files = inputs
    parts = train.pack(files, 100_000, 100_000, tmp_path / "carry", base)
    assert len(parts) >= 3
    parts[1].rename(tmp_path / "lost")
    result = train.join(tmp_path / "carry", tmp_path / "joined")
    assert result.status == "fail" and result.detail.startswith("missing part-2:")
    (tmp_path / "lost").rename(parts[1])
    with (parts[2] / "data.bin").open("r+b") as f:
        f.write(b"x")
    result = train.join(tmp_path / "carry", tmp_path / "joined")
    assert result.status == "fail" and result.detail == "part-3 arrived damaged: carry them again"


def test_only_inputs_beside_the_repository_are_packed(tmp_path):
    with pytest.raises(SystemExit, match="not beside the repository"):
        train.carry_name(Path("/etc/hostname"))
    assert train.carry_name(train.REPO.parent / "shared" / "data" / "x.jsonl") == "shared/data/x.jsonl"


def test_the_house_recipe_reads_the_house_model_and_corpus_from_beside_the_repository():
    keys = train.recipe_inputs(train.REPO / "recipes" / "eagle3-house.yaml")
    assert keys == {"model.target": ["../shared/models/house-code-28m"],
                    "data.train_files": ["../shared/data/code-train.jsonl.xz"]}
    calls = train.device_calls([train.CARRY / "part-1", train.CARRY / "part-2"])
    assert calls[0]["carry"] == [".whl", ".gpu-carry/part-1"] and calls[1]["carry"] == [".gpu-carry/part-2"]
    assert calls[1]["command"].endswith("then make gpu-train; else python3 -m draftsmith.gpu.train run; fi")
    assert "make gpu-check" in calls[0]["command"] and "gpu-check" not in calls[1]["command"]


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


def _module_imports(path: Path) -> set[str]:
    """The top-level names `path` imports at module level (what collecting it needs), relative imports left out."""
    import ast

    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_what_the_gpu_checks_collect_imports_travels_or_is_in_the_image():
    import importlib.metadata
    import sys

    tests = Path(__file__).resolve().parents[1]
    local = {p.stem: p for p in tests.glob("*.py")}
    pending = [tests.parent / path for path in (check.KERNEL_TESTS + check.ENGINE_TESTS)]
    files = [f for p in pending for f in (sorted(p.glob("test_*.py")) if p.is_dir() else [p])] + [local["conftest"]]
    seen: set[str] = set()
    while files:
        seen |= (found := _module_imports(files.pop()) - seen)
        files += [local[name] for name in found if name in local]
    distributions = importlib.metadata.packages_distributions()
    carried = set(wheels.needed_distributions().wheels)
    third_party = sorted(seen - set(sys.stdlib_module_names) - set(local) - {"draftsmith"})
    lacking = [m for m in third_party if not any(in_image(d) or canonical(d) in carried
                                                 for d in distributions.get(m, [m]))]
    assert "jsonschema" in third_party and "torch" in third_party
    assert lacking == []


def test_a_head_comes_back_in_pieces_and_unpacks_whole(tmp_path):
    head = tmp_path / "head"
    head.mkdir()
    weights = bytes(range(256)) * 40  # 10 KiB: three pieces of 4 KiB
    (head / "model.safetensors").write_bytes(weights)
    (head / "config.json").write_text('{"draftsmith_head_type": "eagle3"}')
    (tmp_path / "train_log.jsonl").write_text('{"step": 2}\n')
    out = tmp_path / "out"
    (out / "recipe-a.tar.07").parent.mkdir()
    (out / "recipe-a.tar.07").write_bytes(b"stale")  # an earlier run's piece is not joined in
    pieces = train.bring_back(head, [tmp_path / "train_log.jsonl"], out, "recipe-a", piece=4096)
    assert [p.name for p in pieces] == [f"recipe-a.tar.{k:02d}" for k in range(len(pieces))] and len(pieces) >= 3
    assert all(p.stat().st_size <= 4096 for p in pieces) and not (out / "recipe-a.tar.07").exists()
    (folder,) = train.unpack(out, tmp_path / "here")
    assert folder == tmp_path / "here" / "recipe-a"
    assert (folder / "model.safetensors").read_bytes() == weights
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors", "train_log.jsonl"]
