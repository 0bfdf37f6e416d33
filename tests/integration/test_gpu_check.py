"""`make gpu-wheels`, `make gpu-check` and `make gpu-train` end to end on the CPU, in their dry modes: what a
task lent a GPU runs, proved to install, collect, bench and train before any GPU time is spent."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from draftsmith.gpu import train
from helpers import REPO, shared_path

TRAVEL_LIMIT = 64 * 2**20


def _make(target: str, **variables) -> subprocess.CompletedProcess:
    assignments = [f"{key}={value}" for key, value in variables.items()]
    env = {k: v for k, v in os.environ.items() if k not in ("OUT", "TRITON_INTERPRET")}
    return subprocess.run(["make", "-s", target, f"PY={sys.executable}", *assignments], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module")
def fetched_wheels(tmp_path_factory):
    folder = tmp_path_factory.mktemp("whl")
    done = _make("gpu-wheels", GPU_WHEELS=folder)
    assert done.returncode == 0, done.stdout + done.stderr
    return folder


def test_gpu_wheels_fetch_what_the_image_lacks_and_fit_beside_the_tree(fetched_wheels):
    from draftsmith.gpu.runner import travelling_bytes

    manifest = json.loads((fetched_wheels / "manifest.json").read_text())
    assert manifest["problems"] == []
    names = " ".join(manifest["wheels"])
    assert "pydantic_core-" in names and "cp312-cp312-manylinux" in names and "torch-" not in names
    assert travelling_bytes() + manifest["bytes"] <= TRAVEL_LIMIT - 2**20


def test_gpu_check_dry_mode_runs_every_check(fetched_wheels, tmp_path):
    done = _make("gpu-check", GPU_CHECK_DRY=1, OUT=tmp_path / "out", GPU_WHEELS=fetched_wheels,
                 GPU_SITE=tmp_path / "site")
    assert done.returncode == 0, done.stdout + done.stderr
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    checks = {c["name"]: c for c in summary["checks"]}
    assert summary["dry"] and summary["passed"] and list(checks) == [
        "install", "environment", "kernels-and-steps", "greedy-equality", "bench"]
    assert checks["environment"]["figures"]["draftsmith"].startswith(str(tmp_path / "site"))  # the installed copy
    for name, least in (("kernels-and-steps", 20), ("greedy-equality", 8)):
        assert checks[name]["status"] == "skipped: no CUDA" and checks[name]["figures"]["collected"] >= least
    bench = checks["bench"]["figures"]
    assert bench["shape"] == "tiny" and {row["batch"] for row in bench["rows"]} == {1, 4}
    assert {row["method"] for row in bench["rows"]} == {"none", "eagle3 k=4 accept 0.6", "eagle3 k=4 accept 0.8"}
    assert "bench tiny on cpu" in done.stdout and "gpu-check: passed" in done.stdout


def test_gpu_train_dry_mode_packs_joins_and_trains_the_house_recipe(fetched_wheels, tmp_path):
    shared_path("models", "house-code-28m")
    done = _make("gpu-train", GPU_TRAIN_DRY=1, OUT=tmp_path / "out", GPU_WHEELS=fetched_wheels,
                 GPU_SITE=tmp_path / "site")
    assert done.returncode == 0, done.stdout + done.stderr
    assert re.search(r"receive: (\d+) of \1 parts here", done.stdout), done.stdout
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["passed"] and [c["name"] for c in summary["checks"]] == ["join", "install", "train eagle3-house"]
    assert summary["checks"][2]["figures"]["pieces"] == ["eagle3-house.tar.00"]
    (head,) = train.unpack(tmp_path / "out", tmp_path / "heads")
    assert head.name == "eagle3-house" and (head / "train_log.jsonl").is_file()
    assert json.loads((head / "config.json").read_text())["draftsmith_head_type"] == "eagle3"
    assert (head / "model.safetensors").is_file() and summary["checks"][2]["figures"]["steps"] == 2
