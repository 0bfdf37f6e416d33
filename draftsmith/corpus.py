"""Reading text and chat corpora, shared by training, data generation and benchmarks.

Records are JSONL (optionally .xz/.gz): code files `{"path", "text"}`, OpenAI chats `{"messages": [...]}` or
ShareGPT chats `{"conversations": [{"from", "value"}]}`. Benchmark prompts are cut from code files in the
middle of an indented block line: a prompt cut right after a newline often makes these code models end the
file at once, which measures nothing, while a cut mid-line keeps them writing code.
"""

from __future__ import annotations

import itertools
import json
import lzma
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from draftsmith.errors import DraftsmithError


def read_jsonl(path: str | Path) -> Iterator[dict]:
    path = Path(path)
    if not path.is_file():
        raise DraftsmithError(f"data file {path} does not exist")
    opener = lzma.open if path.suffix == ".xz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if line.strip():
                try:
                    yield json.loads(line)
                except json.JSONDecodeError as exc:
                    raise DraftsmithError(f"{path} line {number}: not valid JSON ({exc.msg})") from None


def cut_inside_block(text: str, min_chars: int) -> str | None:
    """The text up to the middle of the first indented line starting at or after `min_chars`."""
    offset = 0
    for line in text.splitlines(keepends=True):
        content = line.lstrip(" ")
        indent = len(line) - len(content)
        body = content.rstrip("\n")
        if offset >= min_chars and indent >= 4 and len(body) >= 8:
            return text[: offset + indent + len(body) // 2]
        offset += len(line)
    return None


def code_prompts(path: str | Path, num_prompts: int, min_chars: int = 600, max_chars: int = 4000) -> list[str]:
    """The first `num_prompts` files of the split that yield a cut between min_chars and max_chars."""
    prompts: list[str] = []
    for record in read_jsonl(path):
        prompt = cut_inside_block(record.get("text", ""), min_chars)
        if prompt is not None and len(prompt) <= max_chars:
            prompts.append(prompt)
            if len(prompts) == num_prompts:
                break
    if len(prompts) < num_prompts:
        raise DraftsmithError(f"{path} yields only {len(prompts)} prompts, {num_prompts} requested")
    return prompts


def repository(path: str) -> str:
    """A code record's repository: its path's first component (the corpus keeps one repository per one)."""
    return path.split("/", 1)[0]


def held_out_records(path: str | Path, train: str | Path) -> list[dict]:
    """The records of `path` whose repository has no file in `train`: code the heads never saw the like of
    (a split by file shares most repositories with training, and heads accept far more on those)."""
    seen = {repository(record.get("path", "")) for record in read_jsonl(train)}
    return [record for record in read_jsonl(path) if repository(record.get("path", "")) not in seen]


# After a prompt's cut, the next prompt from the same file starts this many characters on: past the code a
# continuation of a few hundred tokens would write, so that no prompt holds another's expected output
WINDOW_GAP = 1000


def code_windows(text: str, min_chars: int, max_chars: int) -> list[str]:
    """Successive prompts from one file: each starts on a line and is cut like `cut_inside_block`."""
    windows, start = [], 0
    while start < len(text):
        prompt = cut_inside_block(text[start:], min_chars)
        if prompt is None:
            break
        if len(prompt) <= max_chars:
            windows.append(prompt)
        next_line = text.find("\n", start + len(prompt) + WINDOW_GAP)
        if next_line < 0:
            break
        start = next_line + 1
    return windows


def held_out_code_prompts(path: str | Path, train: str | Path, num_prompts: int, min_chars: int = 2000,
                          max_chars: int = 4000) -> list[str]:
    """Up to `num_prompts` code prompts from the repositories of `path` that `train` lacks: a window of every
    such file in turn, then a second window of each, and so on (few repositories are held out, so each gives
    several)."""
    by_file = [code_windows(r.get("text", ""), min_chars, max_chars) for r in held_out_records(path, train)]
    prompts = [window for windows in itertools.zip_longest(*by_file) for window in windows if window]
    if not prompts:
        raise DraftsmithError(f"{path} holds no code from a repository that {train} lacks")
    return prompts[:num_prompts]


EDIT_INSTRUCTION = "\n\n# The same code again, rewritten with type hints and docstrings:\n\n"


def edit_prompts(path: str | Path, num_prompts: int, min_chars: int = 600, max_chars: int = 2000) -> list[str]:
    """Code-edit requests for a base code model: a whole file, a comment asking for it rewritten, and the
    file's first line to start the rewrite. What comes next mostly repeats the file: the workload where
    lookup drafting (suffix decoding, n-gram) pays most."""
    prompts: list[str] = []
    for record in read_jsonl(path):
        text = record.get("text", "").strip("\n")
        if min_chars <= len(text) <= max_chars:
            prompts.append(text + EDIT_INSTRUCTION + text.split("\n", 1)[0] + "\n")
            if len(prompts) == num_prompts:
                break
    if len(prompts) < num_prompts:
        raise DraftsmithError(f"{path} yields only {len(prompts)} edit prompts, {num_prompts} requested")
    return prompts


SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "system": "system", "chatgpt": "assistant", "bing": "assistant"}


def load_records(files: list[str], max_samples: int | None = None, skip: int = 0):
    """The records of JSONL files (.xz ok), after the first `skip`, at most `max_samples` of them."""
    import datasets

    missing = [f for f in files if not Path(f).is_file()]
    if missing:
        raise DraftsmithError(f"data files not found: {', '.join(missing)}")
    datasets.disable_progress_bars()
    try:
        ds = datasets.load_dataset("json", data_files=list(files), split="train")
    except Exception as exc:  # datasets wraps parse errors in several types
        raise DraftsmithError(f"cannot read {files}: {exc}") from None
    if skip >= len(ds) > 0:
        raise DraftsmithError(f"{', '.join(files)} holds {len(ds)} records: none left after skipping {skip}")
    end = len(ds) if max_samples is None else min(skip + max_samples, len(ds))
    if skip or end < len(ds):
        ds = ds.select(range(skip, end))
    return ds


def detect_format(columns: list[str]) -> str:
    if "messages" in columns or "conversations" in columns:
        return "chat"
    if "text" in columns:
        return "text"
    raise DraftsmithError(f"records have columns {columns}; expected 'messages', 'conversations' or 'text'")


def to_messages(record: dict[str, Any]) -> list[dict[str, str]]:
    if record.get("messages"):
        return [{"role": m["role"], "content": m["content"]} for m in record["messages"]]
    turns = record.get("conversations") or []
    try:
        return [{"role": SHAREGPT_ROLES[t["from"]], "content": t["value"]} for t in turns]
    except KeyError as exc:
        raise DraftsmithError(f"ShareGPT turn with unknown role {exc.args[0]!r}") from None
