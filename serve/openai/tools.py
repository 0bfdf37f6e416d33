"""Tool calling: `tools` and `tool_choice` on /v1/chat/completions, the call written under a structured-output
constraint and returned in OpenAI's `tool_calls` shape, whole or streamed.

- a named function: the output is that function's arguments, held to its parameters schema; finish "stop"
  (as OpenAI and vLLM answer a forced call);
- "required": the output is a JSON array of one or more {"name", "parameters"} calls of the given tools;
  finish "tool_calls";
- "auto" (OpenAI's default when tools are given): the model answers in text, or calls tools in the Hermes
  format that Qwen's and Hermes' chat templates teach (vLLM's `hermes` parser): `<tool_call>` + a JSON
  {"name", "arguments"} of a given tool + `</tool_call>`, one or more, the JSON held to the tool's schema. The
  grammar lets the answer be either, so a text answer cannot begin with "<"; a model trained on another call
  format is held to this one. Calls finish "tool_calls";
- "none": the tools go to the chat template and the answer is text.
The chat template decides how the tools and earlier calls render.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Literal

from pydantic import BaseModel, Field

from draftsmith.errors import DraftsmithError
from draftsmith.serve.engine.structured_outputs import JSON_OPTIONS, StructuredOutputsParams

ANY_OBJECT = {"type": "object"}
CALL_OPEN, CALL_CLOSE = "<tool_call>\n", "\n</tool_call>"  # the Hermes format, as 'auto' writes calls


class FunctionDefinition(BaseModel):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"] = "function"
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


def resolve_tool_choice(tools: list[Tool] | None, choice: ToolChoice | None) -> ToolChoice | None:
    """The choice in force, checked: None where no tools are given (and none is asked)."""
    if not tools:
        if choice not in (None, "none"):
            raise DraftsmithError("tool_choice: needs tools")
        return None
    choice = choice if choice is not None else "auto"
    if isinstance(choice, NamedToolChoice) and choice.function.name not in {t.function.name for t in tools}:
        raise DraftsmithError(f"tool_choice: no tool is named {choice.function.name!r}")
    return choice


def tool_constraint(tools: list[Tool], choice: ToolChoice, parallel: bool = True) -> StructuredOutputsParams | None:
    """The constraint a call is written under, or None for 'none'; `parallel` False: 'required' makes one."""
    if isinstance(choice, NamedToolChoice):
        tool = next(t for t in tools if t.function.name == choice.function.name)
        return StructuredOutputsParams(json=tool.function.parameters or ANY_OBJECT)
    if choice == "required":
        calls, shared = _calls(tools, "parameters")
        array = {"type": "array", "minItems": 1, "items": {"anyOf": calls}, **shared}
        return StructuredOutputsParams(json=array if parallel else {**array, "maxItems": 1})
    if choice == "auto":
        calls, shared = _calls(tools, "arguments")
        call = {"anyOf": calls, **shared, "x-guidance": JSON_OPTIONS}
        repeat = "+" if parallel else ""
        return StructuredOutputsParams(grammar=(
            f"start: TEXT | calls\nTEXT: /[^<][\\s\\S]*/\n"
            f"calls: ({json.dumps(CALL_OPEN)} call {json.dumps(CALL_CLOSE)}){repeat}\ncall: %json {json.dumps(call)}\n"))
    return None


DEFINITIONS = ("$defs", "definitions")  # where schemas keep what their "#/$defs/..." pointers name


def _calls(tools: list[Tool], arguments: str) -> tuple[list[dict[str, Any]], dict[str, dict]]:
    """A JSON schema per tool of a call {"name": its name, `arguments`: its parameters}, and the tools'
    definitions, which go to the root of the schema that holds the calls: a parameters schema's root pointers
    ("#/$defs/Loc", as pydantic writes them) must resolve there (vLLM's tool schemas do the same)."""
    calls, shared = [], {key: {} for key in DEFINITIONS}
    for tool in tools:
        parameters = dict(tool.function.parameters or ANY_OBJECT)
        for key in DEFINITIONS:
            for name, definition in (parameters.pop(key, None) or {}).items():
                if shared[key].setdefault(name, definition) != definition:
                    raise DraftsmithError(f"tools: two tools define {key}.{name} differently; one schema holds "
                                          "every call, so give them different names")
        calls.append({"type": "object", "properties": {"name": {"const": tool.function.name}, arguments: parameters},
                      "required": ["name", arguments], "additionalProperties": False})
    return calls, {key: found for key, found in shared.items() if found}


def tool_calls(text: str, choice: ToolChoice) -> list[dict[str, Any]] | None:
    """The calls in a finished output, in OpenAI's shape; None where it holds none (text, under 'auto') or no
    whole call of a list (it ran out of tokens first): then it is returned as text. A forced call is a call
    whatever its end, its arguments cut short where the output was (as OpenAI answers at max_tokens, and as it
    streamed)."""
    if isinstance(choice, NamedToolChoice):
        return [_call(choice.function.name, text)]
    try:
        if choice == "auto":
            if not text.startswith(CALL_OPEN):
                return None
            bodies = [part.split(CALL_CLOSE)[0] for part in text.split(CALL_OPEN)[1:]]
            return [_call(call["name"], json.dumps(call["arguments"])) for call in map(json.loads, bodies)]
        value = json.loads(text)
    except (ValueError, KeyError, TypeError):
        return None
    return [_call(call["name"], json.dumps(call["parameters"])) for call in value]


def finish_reason(choice: ToolChoice, engine_reason: str | None) -> str | None:
    """OpenAI's finish reason for calls: 'tool_calls', but the engine's for a forced call (as OpenAI)."""
    return engine_reason if isinstance(choice, NamedToolChoice) or engine_reason != "stop" else "tool_calls"


def _call(name: str, arguments: str) -> dict[str, Any]:
    return {"id": f"chatcmpl-tool-{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


class ToolCallDeltas:
    """A streamed answer under a tool choice: a forced function's arguments go out as they come (the first
    delta names the call); 'required' calls, and 'auto' ones, go out whole once the output is complete, each
    with its index; an 'auto' text answer streams as text."""

    def __init__(self, choice: ToolChoice):
        self.choice, self.text, self.opened = choice, "", False
        self.call = _call(choice.function.name, "") if isinstance(choice, NamedToolChoice) else None

    def delta(self, new_text: str, done: bool) -> dict[str, Any]:
        self.text += new_text
        if self.choice == "auto" and self.text[:1] not in ("", "<"):  # a text answer: streamed as text
            return {"content": new_text} if new_text else {}
        if self.call is not None:
            if not new_text and self.opened:
                return {}
            piece = {"index": 0, "function": {"arguments": new_text}}
            if not self.opened:
                self.opened = True
                piece = {"index": 0, "id": self.call["id"], "type": "function",
                         "function": {"name": self.call["function"]["name"], "arguments": new_text}}
            return {"tool_calls": [piece]}
        if not done:
            return {}
        calls = tool_calls(self.text, self.choice)
        if calls is None:
            return {"content": self.text}
        return {"tool_calls": [{"index": i, **call} for i, call in enumerate(calls)]}
