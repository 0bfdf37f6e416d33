"""`make gpu-train`: the house recipes trained on a lent GPU, the heads brought back in OUT.

The recipes read the house model and the corpus from ../shared, which does not travel, and together they
(81 MB) are more than fits beside the tree in one device call (64 MiB in all). So they go in parts:

- here, `make gpu-train-pack` packs every file the recipes read from outside the repository into
  .gpu-carry/part-1 .. part-N, each small enough to travel beside the tree (part 1 beside .whl too), and
  prints the device calls to make;
- there, one call a part, each within the 30 s a machine stays warm, runs `python3 -m draftsmith.gpu.train
  receive`, which keeps the part in build/ (ignored, so it stays on the warm machine between calls); the
  first call then runs `make gpu-check`;
- the call with the last part ends in `make gpu-train`, which joins and checks the parts, installs the
  carried wheels and draftsmith, trains each recipe with `training.max_minutes` (GPU_TRAIN_MINUTES, 5) and
  brings each head, its evaluation and its log back as OUT/<recipe name>.tar.NN (a call returns 8 files);
- here, `python -m draftsmith.gpu.train unpack FILES_AT DEST` puts each head in DEST/<recipe name>/.

`GPU_TRAIN_DRY=1` runs the same on a CPU: pack, receive, join, then two optimizer steps on short samples.
Standard library only on the GPU side (`receive`, `run`); `pack` runs here, in the venv.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

from draftsmith.gpu.runner import (
    REPO,
    WHEELS,
    Result,
    Setup,
    cuda_available,
    install,
    make_setup,
    report,
    run,
    timed,
    travelling_bytes,
)

RECIPES = ["recipes/eagle3-house.yaml"]
CARRY = REPO / ".gpu-carry"  # what each call carries (ignored)
STAGE = REPO / "build" / "gpu-train"  # parts received, inputs joined, runs (ignored: stays while the machine is warm)
TRAVEL_LIMIT = 64 * 2**20  # what one device call may carry, the tree included
MARGIN = 2**20
PIECE = 15 * 2**20  # under the 16 MiB a returned file may hold
RETURNED_FILES = 8  # the most files one device call brings back from OUT
DRY_OVERRIDES = ["data.max_train_samples=64", "data.max_length=128", "data.max_eval_samples=8", "training.log_every_steps=1",
                 "training.batch_size=2", "training.max_steps=2", "training.save_every_steps=1000"]


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(2**20), b""):
            digest.update(block)
    return digest.hexdigest()


def carry_name(path: Path, base: Path = REPO.parent) -> str:
    """Where an input outside the repository lands in the joined inputs: its path from the repository's
    parent folder (../shared/models/x -> shared/models/x)."""
    relative = Path(os.path.relpath(os.path.abspath(path), base))  # links kept: ../shared may be one
    if relative.parts[0] == ".." or relative.parts[0] == REPO.name:
        raise SystemExit(f"gpu-train: {path} is not beside the repository; only ../<folder> inputs can be packed")
    return relative.as_posix()


def recipe_inputs(recipe: Path) -> dict[str, list[str]]:
    """The recipe's keys that name files outside the repository: override key -> the paths it names."""
    import yaml

    data = yaml.safe_load(recipe.read_text())
    keys = {"model.target": [data["model"]["target"]], "data.train_files": data["data"]["train_files"],
            "data.eval_files": data["data"].get("eval_files") or []}
    return {key: paths for key, paths in keys.items()
            if paths and all(not Path(os.path.abspath(REPO / p)).is_relative_to(REPO) for p in paths)}


def input_files(recipes: list[str]) -> list[Path]:
    files = set()
    for recipe in recipes:
        for paths in recipe_inputs(REPO / recipe).values():
            for path in (Path(os.path.abspath(REPO / p)) for p in paths):
                files.update(f for f in path.iterdir() if f.is_file()) if path.is_dir() else files.add(path)
    return sorted(files)


def pack(files: list[Path], first_room: int, room: int, carry: Path = CARRY, base: Path = REPO.parent) -> list[Path]:
    """Writes carry/part-K/data.bin: consecutive slices of the files' concatenation, `first_room` bytes in
    part 1 (which travels beside .whl), `room` in the others; and the manifest (files by carry name, sizes,
    hashes; the parts' hashes) in every part; -> the part folders."""
    shutil.rmtree(carry, ignore_errors=True)
    parts, sink, left, capacity = [], None, 0, first_room
    for path in files:
        with path.open("rb") as source:
            while chunk := source.read(2**20):
                while chunk:
                    if left == 0:
                        sink = _next_part(parts, sink, carry)
                        left, capacity = capacity, room
                    sink.write(chunk[:left])
                    chunk, left = chunk[left:], left - len(chunk[:left])
    if sink:
        sink.close()
    manifest = {"files": [{"name": carry_name(p, base), "size": p.stat().st_size, "sha256": sha256(p)} for p in files],
                "parts": [sha256(part / "data.bin") for part in parts]}
    for part in parts:
        (part / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return parts


def _next_part(parts: list[Path], sink, carry: Path):
    if sink:
        sink.close()
    parts.append(carry / f"part-{len(parts) + 1}")
    parts[-1].mkdir(parents=True)
    return (parts[-1] / "data.bin").open("wb")


def device_calls(parts: list[Path]) -> list[dict]:
    """The device calls that bring the parts over and train, in order (`run`'s carry and command). The first
    also runs `make gpu-check` (about 3 minutes), which keeps the machine warm for the next call: one lent GPU
    gets the check and the training in about 7 minutes of its 15."""
    calls = []
    for index, part in enumerate(parts, 1):
        carry = ([".whl"] if index == 1 else []) + [part.relative_to(REPO).as_posix()]
        command = "python3 -m draftsmith.gpu.train receive"
        if index == 1:
            command += ("; if command -v make >/dev/null; then make gpu-check; "
                        "else python3 -m draftsmith.gpu.check; fi")
        if index == len(parts):
            # not `make ... || python3 ...`: a failed training would run again
            command += (" && if command -v make >/dev/null; then make gpu-train; "
                        "else python3 -m draftsmith.gpu.train run; fi")
        calls.append({"carry": carry, "command": command})
    return calls


def receive(carry: Path = CARRY, received: Path = STAGE / "parts") -> int:
    """On the GPU: moves the parts this call carried into build/gpu-train/parts and says which are missing."""
    received.mkdir(parents=True, exist_ok=True)
    for part in sorted(carry.glob("part-*")):
        shutil.rmtree(received / part.name, ignore_errors=True)
        shutil.move(str(part), received / part.name)
    manifests = sorted(received.glob("part-*/manifest.json"))
    if not manifests:
        print("gpu-train receive: no part here; carry .gpu-carry/part-K (make gpu-train-pack writes them)")
        return 1
    total = len(json.loads(manifests[0].read_text())["parts"])
    missing = [k for k in range(1, total + 1) if not (received / f"part-{k}" / "data.bin").is_file()]
    print(f"gpu-train receive: {total - len(missing)} of {total} parts here" +
          (f"; still to carry: {', '.join(f'.gpu-carry/part-{k}' for k in missing)}" if missing else ""))
    return 0


def join(received: Path, inputs: Path) -> Result:
    """Checks every received part against the manifest and cuts their concatenation back into the files."""
    manifests = sorted(received.glob("part-*/manifest.json"))
    if not manifests:
        return Result("join", "fail", detail="no parts received: run the calls `make gpu-train-pack` printed")
    manifest = json.loads(manifests[0].read_text())
    parts = [received / f"part-{k}" / "data.bin" for k in range(1, len(manifest["parts"]) + 1)]
    missing = [p.parent.name for p in parts if not p.is_file()]
    if missing:
        return Result("join", "fail", detail=f"missing {', '.join(missing)}: the machine went back between calls, "
                      "or a call was skipped; carry them again, each within 30 s of the last")
    bad = [p.parent.name for p, want in zip(parts, manifest["parts"]) if sha256(p) != want]
    if bad:
        return Result("join", "fail", detail=f"{', '.join(bad)} arrived damaged: carry them again")
    _cut(parts, manifest["files"], inputs)
    wrong = [f["name"] for f in manifest["files"] if sha256(inputs / f["name"]) != f["sha256"]]
    if wrong:
        return Result("join", "fail", detail=f"joined files differ from the originals: {', '.join(wrong)}")
    return Result("join", "pass", detail=f"{len(manifest['files'])} files from {len(parts)} parts",
                  figures={"bytes": sum(f["size"] for f in manifest["files"])})


def _cut(parts: list[Path], files: list[dict], inputs: Path) -> None:
    stream, pending = _chunks(parts), b""
    for entry in files:
        target = inputs / entry["name"]
        target.parent.mkdir(parents=True, exist_ok=True)
        with target.open("wb") as sink:
            left = entry["size"]
            while left:
                pending = pending or next(stream)
                sink.write(pending[:left])
                left, pending = left - len(pending[:left]), pending[left:]


def _chunks(parts: list[Path]):
    for part in parts:
        with part.open("rb") as source:
            yield from iter(lambda: source.read(2**20), b"")


def train_recipe(recipe: str, setup: Setup, inputs: Path, timeout: float) -> Result:
    """Trains one recipe on the joined inputs for GPU_TRAIN_MINUTES of its loop; brings the head, its last
    evaluation and its log back as OUT/<recipe name>.tar.NN (`bring_back`)."""
    name = Path(recipe).stem
    output = STAGE / "runs" / name
    shutil.rmtree(output, ignore_errors=True)  # a fresh run: a leftover checkpoint would be resumed
    overrides = [f"training.output_dir={output}", f"training.max_minutes={setup.env.get('GPU_TRAIN_MINUTES', 5)}"]
    for key, paths in recipe_inputs(REPO / recipe).items():
        joined = [str(inputs / carry_name(REPO / p)) for p in paths]
        overrides.append(f"{key}={json.dumps(joined[0] if key == 'model.target' else joined)}")
    if setup.dry:
        overrides += DRY_OVERRIDES
    code, tail = run([sys.executable, "-m", "draftsmith.train", recipe, *overrides], setup, timeout, f"train {name}")
    if code != 0 or not (output / "head" / "model.safetensors").is_file():
        return Result(f"train {name}", "timeout" if code is None else "fail", detail=tail)
    evaluations = sorted(output.glob("eval_*.json"), key=lambda p: p.stat().st_mtime)
    extras = [p for p in [*evaluations[-1:], output / "train_log.jsonl"] if p.is_file()]
    pieces = bring_back(output / "head", extras, setup.out, name)
    log = (output / "train_log.jsonl").read_text().splitlines() if (output / "train_log.jsonl").is_file() else []
    figures = {"steps": json.loads(log[-1])["step"] if log else 0, "pieces": [p.name for p in pieces],
               "evaluation": json.loads(evaluations[-1].read_text()) if evaluations else None}
    return Result(f"train {name}", "pass", detail=f"{len(pieces)} file(s) {name}.tar.*", figures=figures)


def bring_back(head: Path, extras: list[Path], out: Path, name: str, piece: int = PIECE) -> list[Path]:
    """Writes the head's files and `extras` as one tar, cut into out/<name>.tar.00, .01 ... of at most `piece`
    bytes: a device call returns at most 8 files of 16 MiB, so a head is a piece or a few, never a file each.
    `python -m draftsmith.gpu.train unpack` joins and extracts them here."""
    import io
    import tarfile

    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob(f"{name}.tar.*"):
        stale.unlink()
    buffer = io.BytesIO()  # a head is tens of MB at most: built in memory, cut without a second pass on disk
    with tarfile.open(fileobj=buffer, mode="w") as archive:
        for path in [*sorted(head.iterdir()), *extras]:
            archive.add(path, arcname=path.name)
    whole = buffer.getbuffer()
    pieces = [out / f"{name}.tar.{k:02d}" for k in range(-(-len(whole) // piece))]
    for k, path in enumerate(pieces):
        path.write_bytes(whole[k * piece:(k + 1) * piece])
    return pieces


def unpack(returned: Path, dest: Path) -> list[Path]:
    """Here: joins every <name>.tar.NN in `returned` (a call's files_at) and extracts it into dest/<name>/;
    -> the folders written."""
    import io
    import tarfile

    names = sorted({p.name.rsplit(".tar.", 1)[0] for p in returned.glob("*.tar.[0-9][0-9]")})
    folders = []
    for name in names:
        blob = b"".join(p.read_bytes() for p in sorted(returned.glob(f"{name}.tar.[0-9][0-9]")))
        folder = dest / name
        shutil.rmtree(folder, ignore_errors=True)
        with tarfile.open(fileobj=io.BytesIO(blob)) as archive:
            archive.extractall(folder, filter="data")
        folders.append(folder)
    return folders


def run_all(recipes: list[str]) -> int:
    """`make gpu-train` on the GPU (or dry on a CPU): join, install, train every recipe, summarise."""
    setup = make_setup(dict(os.environ), "gpu-train", 570)
    if not setup.dry and not cuda_available(setup):
        print("gpu-train: no CUDA device here; GPU_TRAIN_DRY=1 runs the dry mode on a CPU", file=sys.stderr)
        return 2
    inputs = STAGE / "inputs"
    results = [timed("join", join, STAGE / "parts", inputs)]
    if results[-1].status == "pass":
        results.append(timed("install", install, setup))
    if results[-1].status == "pass":
        results += [timed(f"train {Path(r).stem}", train_recipe, r, setup, inputs, setup.seconds_left(540))
                    for r in recipes]
    returned = sum(len(r.figures.get("pieces", [])) for r in results) + 2  # + summary.json and log.txt
    if returned > RETURNED_FILES:
        print(f"gpu-train: {returned} files in OUT; a device call returns {RETURNED_FILES}: train fewer recipes a call")
    for r in results:
        print(f"{r.name:22s} {r.status:8s} {r.seconds:7.1f} s  {r.detail.splitlines()[-1] if r.detail else ''}"[:160])
        if r.figures.get("evaluation"):
            print(f"  after {r.figures['steps']} steps: {json.dumps(r.figures['evaluation'])}"[:400])
    return report("gpu-train", setup, results)


def pack_and_plan(recipes: list[str]) -> int:
    room = TRAVEL_LIMIT - travelling_bytes() - MARGIN
    first_room = room - sum(p.stat().st_size for p in WHEELS.glob("*.whl"))  # part 1 travels beside .whl
    if first_room < 4 * 2**20:
        print(f"gpu-train pack: {first_room / 2**20:.1f} MiB left beside the tree and .whl: too little to pack",
              file=sys.stderr)
        return 1
    parts = pack(input_files(recipes), first_room, room)
    calls = device_calls(parts)
    (CARRY / "calls.json").write_text(json.dumps(calls, indent=1) + "\n")
    for part in parts:
        print(f"  {(part / 'data.bin').stat().st_size / 2**20:6.1f} MiB  {part.relative_to(REPO)}")
    print(f"gpu-train pack: {len(parts)} parts; {room / 2**20:.1f} MiB travels beside the tree in each call. "
          "The device calls, in order, each within 30 s of the last (warm machine):")
    for index, call in enumerate(calls, 1):
        print(f"  {index}. carry {json.dumps(call['carry'])}  command: {call['command']}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    verb, recipes = (argv[0] if argv else ""), (argv[1:] or RECIPES)
    if verb == "pack":
        return pack_and_plan(recipes)
    if verb == "receive":
        return receive()
    if verb == "run":
        return run_all(recipes)
    if verb == "unpack" and len(argv) == 3:
        for folder in unpack(Path(argv[1]), Path(argv[2])):
            print(f"gpu-train unpack: {folder}")
        return 0
    print("usage: python -m draftsmith.gpu.train pack|receive|run [RECIPE ...] | unpack FILES_AT DEST\n"
          + (__doc__ or ""), file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
