"""The import root maps the top-level folders, as the layout promises."""

from pathlib import Path

import pytest

import draftsmith.convert
import draftsmith.models
import draftsmith.serve
import draftsmith.train
from helpers import REPO


def test_top_level_folders_are_draftsmith_subpackages():
    for module, folder in [(draftsmith.models, "models"), (draftsmith.serve, "serve"),
                           (draftsmith.train, "train"), (draftsmith.convert, "convert")]:
        assert Path(module.__file__).resolve().parent == REPO / folder


@pytest.mark.slow
def test_the_wheel_holds_every_package_folder(tmp_path):
    """Packages are found, not listed (setup.py): a wheel built from the tree holds every folder with an
    `__init__.py` under the folders mapped into draftsmith, a new method folder included, with no edit."""
    import shutil
    import subprocess
    import sys
    import zipfile

    tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11")
    roots = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(REPO / name, source / name)
    for folder in set(roots.values()):
        shutil.copytree(REPO / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__"))
    new_method = source / "draftsmith" / "methods" / "toy_new_method"
    new_method.mkdir()
    (new_method / "__init__.py").write_text("")
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(tmp_path / "wheel"), str(source)], capture_output=True, text=True)
    assert built.returncode == 0, built.stderr[-2000:]
    wheel = next((tmp_path / "wheel").glob("draftsmith-*.whl"))
    in_wheel = {name.rsplit("/", 1)[0].replace("/", ".") for name in zipfile.ZipFile(wheel).namelist()
                if name.endswith("/__init__.py")}
    found = set()
    for package, folder in roots.items():
        for init in (source / folder).rglob("__init__.py"):
            found.add(".".join([package, *init.parent.relative_to(source / folder).parts]))
    assert "draftsmith.methods.toy_new_method" in found
    assert found == in_wheel
    # the CPU kernels are built from the installed package's folder at first use: every source and header
    from draftsmith.models.slot_attention_cpu import HEADERS, SOURCES
    assert {f"draftsmith/models/{path.name}" for path in SOURCES + HEADERS} <= set(zipfile.ZipFile(wheel).namelist())


def test_make_bench_passes_valid_speculative_configs():
    """Every --speculative-config `make bench` hands the shell parses as JSON (a backslash-newline inside a
    quoted recipe argument reaches the shell as it is and had broken one)."""
    import json
    import shlex
    import shutil
    import subprocess

    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    recipe = subprocess.run(["make", "-n", "bench"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    words = shlex.split(recipe)  # as sh reads it: a backslash-newline inside quotes stays
    configs = [words[i + 1] for i, word in enumerate(words) if word == "--speculative-config"]
    assert len(configs) >= 3
    for config in configs:
        json.loads(config)
