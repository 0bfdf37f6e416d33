"""What serving needs of a model besides its weights: the tokenizer, the chat template and the checks a request
must pass (once, here: `engine.checks`). `LLM` is one (with its engine beside); with the engine in its own process (`engine_process`),
the API process holds a bare `Frontend` and never loads the weights."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from draftsmith.errors import DraftsmithError
from draftsmith.models.tokenizer import load_tokenizer
from draftsmith.serve.engine.checks import CheckedRequest, RequestLimits
from draftsmith.serve.engine.sampling_params import SamplingParams

PromptInput = str | dict[str, Any]  # text, or {"prompt_token_ids": [...]} / {"prompt": str}


class Frontend:
    def __init__(self, model_dir: str | Path, tokenizer, max_model_len: int, vocab_size: int, max_num_seqs: int):
        self.model_dir = Path(model_dir)
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.max_num_seqs = max_num_seqs

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, max_model_len: int, vocab_size: int, max_num_seqs: int) -> Frontend:
        return cls(model_dir, load_tokenizer(model_dir), max_model_len, vocab_size, max_num_seqs)

    def encode(self, prompt: PromptInput) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            return self.encode(prompt["prompt"])
        if self.tokenizer is None:
            raise DraftsmithError("text prompts need a tokenizer, and this LLM has none (skip_tokenizer_init): "
                                  "pass {\"prompt_token_ids\": [...]}")
        return prompt, self.tokenizer(prompt, add_special_tokens=False).input_ids

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        if self.tokenizer is None or not self.tokenizer.chat_template:
            raise DraftsmithError(f"the tokenizer in {self.model_dir} has no chat template")
        try:
            return self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
        except Exception as exc:  # jinja errors on malformed messages
            raise DraftsmithError(f"chat template failed on messages {messages!r}: {exc}") from None

    @property
    def limits(self) -> RequestLimits:
        return RequestLimits(self.max_model_len, self.vocab_size, self.max_num_seqs)

    def check(self, prompt_token_ids: list[int], params: SamplingParams, prompt: str | None = None) -> CheckedRequest:
        """The request, checked once here for whichever engine runs it (`engine.checks`), its bad_words
        tokenized."""
        return self.limits.check(prompt_token_ids, params.with_tokenizer(self.tokenizer), prompt)

    @functools.cached_property
    def max_text_bytes(self) -> int:
        """UTF-8 bytes of text past which a prompt cannot fit max_model_len tokens, whatever it says: no token
        stands for more bytes than the vocabulary's longest, and a normalizer (NFKC, NFC) shrinks text at most
        4-fold. The server refuses longer text without tokenizing it."""
        from draftsmith.serve.engine.detokenizer import token_bytes

        longest = max(len(token_bytes(self.tokenizer, i)) for i in range(len(self.tokenizer)))
        return self.max_model_len * max(longest, 1) * 4

    def check_text(self, text: str, what: str = "prompt") -> None:
        """Refuses text that cannot fit the context (`max_text_bytes`) before it is tokenized."""
        if self.tokenizer is not None and len(text) * 4 > self.max_text_bytes:  # 1-4 bytes a character
            size = len(text.encode())
            if size > self.max_text_bytes:
                raise DraftsmithError(f"{what} is {size} bytes of text, more than max_model_len {self.max_model_len} "
                                      f"tokens of this tokenizer can hold ({self.max_text_bytes} bytes)")
