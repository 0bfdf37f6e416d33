"""Structured outputs: a request's output held to a JSON schema, a regex, a list of choices or a grammar, through
llguidance.

llguidance rather than xgrammar: it installs as one abi3 wheel with no dependencies (xgrammar pulls a torch of
its own choosing, which here could be a CUDA build), computes a mask in ~30 us on this CPU for an 8192-token
vocabulary with no per-grammar compile step, rolls back consumed tokens, and reports forced tokens (the
grammar's deterministic stretches); vLLM serves it as its `guidance` backend, so grammars mean the same there.

A request's constraint is compiled and checked against the tokenizer where the request enters (a bad schema or
regex is a 400); each request then holds a matcher (`GrammarRow`) that has consumed its output. The token mask
at a position is the matcher's after that position's drafted prefix: consumed, masked, rolled back.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from draftsmith.errors import DraftsmithError

logger = logging.getLogger("draftsmith")

KINDS = ("json", "regex", "choice", "grammar", "json_object")
# JSON is written compactly, as json.dumps writes it: a small model given free whitespace may emit it until
# max_tokens and never close the object. `whitespace_pattern` opens it up.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class StructuredOutputsParams:
    """vLLM's `StructuredOutputsParams`: exactly one of json (a schema, as a dict or JSON text), regex, choice
    (a list of strings), grammar (Lark, or GBNF/EBNF as llama.cpp writes it) or json_object (any JSON object)."""

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    whitespace_pattern: str | None = None  # a regex for the whitespace JSON may hold between tokens

    def __post_init__(self) -> None:
        given = [kind for kind in KINDS if getattr(self, kind) not in (None, False)]
        if len(given) != 1:
            raise DraftsmithError("structured_outputs: give exactly one of json, regex, choice, grammar or "
                                  f"json_object (got {', '.join(given) or 'none'})")
        if self.choice is not None and not self.choice:
            raise DraftsmithError("structured_outputs.choice: at least one choice is needed")

    def to_grammar(self) -> str:
        """The constraint as an llguidance grammar (JSON text); DraftsmithError where it cannot be one."""
        from llguidance import LLMatcher, grammar_from

        options = dict(JSON_OPTIONS)
        if self.whitespace_pattern is not None:
            options = {"whitespace_flexible": True, "whitespace_pattern": self.whitespace_pattern}
        try:
            if self.json is not None or self.json_object:
                schema = self.json if self.json is not None else {"type": "object"}
                schema = json.loads(schema) if isinstance(schema, str) else schema
                return LLMatcher.grammar_from_json_schema(schema, overrides=options)
            if self.regex is not None:
                return LLMatcher.grammar_from_regex(self.regex)
            if self.choice is not None:
                return grammar_from("choice", json.dumps(self.choice))
            return grammar_from("grammar", self.grammar)
        except ValueError as exc:
            raise DraftsmithError(f"structured_outputs: {exc}") from None


def grammar_tokenizer(tokenizer, vocab: int | None = None):
    """llguidance's view of `tokenizer` whose masks cover `vocab` tokens at least (the model's vocabulary may
    be larger than the tokenizer's: Qwen2's 151936 for 151665), built once per (tokenizer, vocab): ~0.1 s."""
    with _LOCK:
        cached = tokenizer.__dict__.setdefault("_draftsmith_llguidance", {})
        size = max(vocab or 0, len(tokenizer))
        if size not in cached:
            import llguidance.hf

            cached[size] = llguidance.hf.from_tokenizer(tokenizer, n_vocab=size)
        return cached[size]


_LOCK = threading.Lock()


def compile_constraint(spec: StructuredOutputsParams, tokenizer) -> str:
    """The constraint's grammar, checked against the tokenizer: DraftsmithError naming what is wrong."""
    from llguidance import LLMatcher

    if tokenizer is None:
        raise DraftsmithError("structured outputs need a tokenizer, and this engine has none (skip_tokenizer_init)")
    grammar = spec.to_grammar()
    failed, messages = LLMatcher.validate_grammar_with_warnings(grammar, grammar_tokenizer(tokenizer))
    if failed:
        raise DraftsmithError(f"structured_outputs: {messages[0].strip()}")
    return grammar


@dataclass
class GrammarTime:
    """Seconds the engine's matchers spent (consuming, masking, rolling back) and the masks they made."""

    seconds: float = 0.0
    masks: int = 0


class GrammarRow:
    """One request's matcher, kept at its output: `sync` consumes tokens it gained, `masks` gives the allowed
    tokens after each drafted prefix; time spent goes to `spent`."""

    def __init__(self, grammar: str, tokenizer, vocab: int, stop_tokens: list[int], spent: GrammarTime | None = None):
        from llguidance import LLMatcher

        self.matcher = LLMatcher(grammar_tokenizer(tokenizer, vocab), grammar)
        self.vocab, self.consumed, self.failed = vocab, 0, False
        self.spent = spent if spent is not None else GrammarTime()
        self.fallback = torch.zeros(vocab, dtype=torch.bool)  # nothing allowed (matcher stopped past EOS, or failed)
        self.fallback[stop_tokens] = True

    def sync(self, output_token_ids: list[int]) -> None:
        new = output_token_ids[self.consumed:]
        if new:
            start = time.perf_counter()
            stopped = self.matcher.is_stopped()  # past its end only EOS may follow (min_tokens can ask for more)
            if not self.matcher.consume_tokens(new) and not stopped and not self.failed:
                # a token the masks allowed was refused: the matcher is stuck; from here its fallback holds
                self.failed = True
                logger.warning("structured output matcher refused tokens %s: %s", new, self.matcher.get_error())
            self.consumed = len(output_token_ids)
            self.spent.seconds += time.perf_counter() - start

    def masks(self, prefixes: list[list[int]]) -> torch.Tensor:
        """[N, V] bool: the tokens the grammar allows after each prefix of drafts. A prefix the grammar
        refuses, or one through padding (-1: past the row's drafts), cannot be reached (its first refused draft
        is rejected), so its row is left all True."""
        start = time.perf_counter()
        out = torch.ones(len(prefixes), self.vocab, dtype=torch.bool)
        for n, prefix in enumerate(prefixes):
            if prefix and min(prefix) < 0:
                continue
            taken = self.matcher.try_consume_tokens(prefix) if prefix else 0
            try:
                if taken == len(prefix):
                    out[n] = self._mask()
            finally:  # the matcher stays at the output whatever happens here
                if taken:
                    self.matcher.rollback(taken)
        self.spent.seconds += time.perf_counter() - start
        self.spent.masks += len(prefixes)
        return out

    def forced_tokens(self) -> list[int]:
        """Tokens the grammar allows alone from here (a key, `": "`): drafts that cannot be rejected."""
        return self.matcher.compute_ff_tokens() if not self.matcher.is_error() else []

    def _mask(self) -> torch.Tensor:
        if self.matcher.is_error():
            return self.fallback
        words = torch.from_numpy(np.frombuffer(self.matcher.compute_bitmask(), dtype=np.int32).astype(np.int64))
        bits = ((words[:, None] >> torch.arange(32)) & 1).reshape(-1).bool()
        allowed = torch.zeros(self.vocab, dtype=torch.bool)  # tokens past the mask's end: never allowed
        allowed[: min(len(bits), self.vocab)] = bits[: self.vocab]
        return allowed if allowed.any() else self.fallback


def response_format_constraint(response_format: dict[str, Any] | None) -> StructuredOutputsParams | None:
    """OpenAI's `response_format` as a constraint: json_object, or json_schema's schema; text is none."""
    if response_format is None or response_format.get("type") == "text":
        return None
    if response_format.get("type") == "json_object":
        return StructuredOutputsParams(json_object=True)
    schema = (response_format.get("json_schema") or {}).get("schema")
    return StructuredOutputsParams(json=schema if schema is not None else {"type": "object"})
