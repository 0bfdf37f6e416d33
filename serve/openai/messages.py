"""Chat messages as OpenAI's clients send them (content a string, text parts, or null beside tool calls; tool
results), checked, and as chat templates read them."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, model_validator


class ContentPart(BaseModel):
    """One part of a message's content: text is read; other kinds (images, audio, files) are refused, since
    the served model reads text only."""

    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None

    @model_validator(mode="after")
    def _text_only(self):
        if self.type != "text":
            raise ValueError(f"content part type {self.type!r} is not supported: this model reads text parts only")
        if self.text is None:
            raise ValueError("a text content part needs its text")
        return self


class ToolCallFunction(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(BaseModel):
    """A chat message as OpenAI's clients send it: content a string, a list of text parts or (an assistant
    message that calls tools) null; tool results as `tool` messages naming the call they answer."""

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _content_or_tool_calls(self):
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content: only an assistant message with tool_calls may have none")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("tool_calls: only assistant messages call tools")
        return self

    def text(self) -> str:
        """The content as one string: text parts joined by newlines (as vLLM joins them), none as ''."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "\n".join(part.text for part in self.content)

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates read it (HF's convention: tool call arguments as a dict where they
        are a JSON object)."""
        message: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            message["tool_calls"] = [{"id": call.id, "type": call.type, "function": {
                "name": call.function.name, "arguments": _json_or_text(call.function.arguments)}}
                for call in self.tool_calls]
        return message


def _json_or_text(text: str) -> Any:
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text
