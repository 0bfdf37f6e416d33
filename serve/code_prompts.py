"""Benchmark and test prompts cut from the code corpus (`{"path", "text"}` JSONL, optionally .xz).

A prompt cut right after a newline often makes these code models end the file at once, which measures
nothing; cutting in the middle of an indented block line keeps them writing code (see shared/README.md).
"""

from __future__ import annotations

import json
import lzma
from collections.abc import Iterator
from pathlib import Path

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
