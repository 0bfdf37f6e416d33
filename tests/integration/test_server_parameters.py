"""What a vLLM client sends, through a speculating server and the official `openai` client: every sampling
parameter changes the answer as it says and gives the tokens plain decoding gives; chat content parts, tool
calls and tool messages are read; a bad value is a 400 naming its field."""

import json

import httpx
import jsonschema
import openai
import pytest

from draftsmith.serve import LLM, SamplingParams
from draftsmith.serve.openai.cli import build_server_app, server_in_thread
from helpers import DEMO_MODEL, make_speculation_pay

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
PROMPT = "import os\n\n\ndef walk(root):\n    for dirpath, dirs, files in os.wa"


@pytest.fixture(scope="module")
def served():
    llm = LLM(DEMO_MODEL, dtype="float32", device="cpu", max_num_seqs=4, max_model_len=256, speculative_config=SPEC)
    make_speculation_pay(llm)
    plain = LLM(DEMO_MODEL, dtype="float32", device="cpu", max_num_seqs=4, max_model_len=256, target=llm.model)
    with server_in_thread(build_server_app(llm, "demo", api_key=KEY)) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120), url, plain, llm


def _completion(client, **fields) -> str:
    extra = {k: fields.pop(k) for k in list(fields) if k not in ("temperature", "seed", "logit_bias",
                                                                  "presence_penalty", "frequency_penalty")}
    return client.completions.create(model="demo", prompt=PROMPT, max_tokens=24, extra_body=extra,
                                     **{"temperature": 0.0, **fields}).choices[0].text


def _plain(plain, **fields) -> str:
    params = SamplingParams(max_tokens=24, **{"temperature": 0.0, **fields})
    return plain.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].text


def test_each_parameter_changes_the_answer_and_speculation_keeps_plain_decodings(served):
    client, _, plain, llm = served
    base = _completion(client)
    first = plain.generate([PROMPT], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)[0].outputs[0].token_ids[0]
    cases = [{"repetition_penalty": 1.3}, {"presence_penalty": 2.0}, {"frequency_penalty": 2.0},
             {"presence_penalty": -2.0}, {"logit_bias": {str(first): -100}},
             {"min_p": 0.99, "temperature": 1.0, "seed": 5}, {"bad_words": ["dirpath"]},
             {"allowed_token_ids": list(range(50, 3000))}]
    before = llm.get_metrics()["num_accepted_tokens"]
    for fields in cases:
        text = _completion(client, **fields)
        assert text != base or "min_p" in fields, fields
        engine_fields = {**fields, "logit_bias": {int(k): v for k, v in fields["logit_bias"].items()}} \
            if "logit_bias" in fields else fields
        assert text == _plain(plain, **engine_fields), fields
    assert _completion(client, min_p=0.99, temperature=1.0, seed=5) == base  # min_p 0.99 leaves the argmax here
    assert _completion(client, temperature=1.0, seed=5) != base
    assert llm.get_metrics()["num_accepted_tokens"] > before


def test_chat_content_parts_tool_calls_and_tool_messages_are_read(served):
    client, url, _, _ = served
    as_text = client.chat.completions.create(model="demo", max_tokens=8, temperature=0,
                                             messages=[{"role": "user", "content": "hi\nthere"}])
    as_parts = client.chat.completions.create(model="demo", max_tokens=8, temperature=0, messages=[
        {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]}])
    assert as_parts.choices[0].message.content == as_text.choices[0].message.content
    call = {"id": "call_1", "type": "function", "function": {"name": "walk", "arguments": "{\"root\": \"/\"}"}}
    answered = client.chat.completions.create(model="demo", max_tokens=8, temperature=0, messages=[
        {"role": "user", "content": "walk /"}, {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "['a.py']"}])
    assert answered.choices[0].finish_reason in ("stop", "length")
    tokens = httpx.post(f"{url}/tokenize", headers=AUTH, json={"messages": [
        {"role": "user", "content": [{"type": "text", "text": "hi"}]}]}).json()["tokens"]
    assert tokens == httpx.post(f"{url}/tokenize", headers=AUTH, json={"messages": [
        {"role": "user", "content": "hi"}]}).json()["tokens"]


@pytest.mark.parametrize("fields, needle", [
    ({"presence_penalty": -5}, "presence_penalty"), ({"frequency_penalty": 2.5}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"min_p": 1.5}, "min_p"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"), ({"logit_bias": {"1": 150}}, "logit_bias"),
    ({"logit_bias": {"99999": 1}}, "logit_bias"), ({"min_tokens": 30, "max_tokens": 8}, "min_tokens"),
    ({"allowed_token_ids": []}, "allowed_token_ids"), ({"allowed_token_ids": [10**6]}, "allowed_token_ids"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"), ({"bad_words": "return"}, "bad_words"),
])
def test_bad_values_are_a_400_naming_the_field(served, fields, needle):
    _, url, _, _ = served
    response = httpx.post(f"{url}/v1/completions", headers=AUTH,
                          json={"model": "demo", "prompt": "x", "max_tokens": 8, **fields})
    assert response.status_code == 400, response.text
    assert needle in response.json()["error"]["message"]


@pytest.mark.parametrize("message, needle", [
    ({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}, "image_url"),
    ({"role": "user", "content": None}, "content"),
    ({"role": "user", "content": [{"type": "text"}]}, "needs its text"),
    ({"role": "tool", "content": "x", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}, "tool_calls"),
])
def test_bad_messages_are_a_400_naming_what_is_wrong(served, message, needle):
    _, url, _, _ = served
    response = httpx.post(f"{url}/v1/chat/completions", headers=AUTH,
                          json={"model": "demo", "max_tokens": 4, "messages": [message]})
    assert response.status_code == 400, response.text
    assert needle in response.json()["error"]["message"]


WALK = {"type": "object", "properties": {"root": {"type": "string", "maxLength": 12}, "depth": {"type": "integer"}},
        "required": ["root", "depth"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "walk", "description": "walk a folder", "parameters": WALK}},
         {"type": "function", "function": {"name": "read", "parameters": {
             "type": "object", "properties": {"path": {"type": "string", "maxLength": 12}}, "required": ["path"],
             "additionalProperties": False}}}]
ASK = [{"role": "user", "content": "walk the root folder"}]


def test_a_tool_call_round_trips_through_the_openai_client(served):
    client = served[0]
    named = {"type": "function", "function": {"name": "walk"}}
    answer = client.chat.completions.create(model="demo", messages=ASK, tools=TOOLS, tool_choice=named,
                                            max_tokens=60, temperature=0)
    [call] = answer.choices[0].message.tool_calls
    assert call.function.name == "walk" and answer.choices[0].message.content is None
    jsonschema.validate(json.loads(call.function.arguments), WALK)
    streamed, finish = "", None
    for chunk in client.chat.completions.create(model="demo", messages=ASK, tools=TOOLS, tool_choice=named,
                                                max_tokens=60, temperature=0, stream=True):
        finish = chunk.choices[0].finish_reason or finish
        for piece in chunk.choices[0].delta.tool_calls or []:
            assert piece.index == 0 and (piece.function.name in (None, "walk"))
            streamed += piece.function.arguments or ""
    assert streamed == call.function.arguments and finish == "stop"
    reply = client.chat.completions.create(model="demo", max_tokens=8, temperature=0, messages=[
        *ASK, answer.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "['a.py', 'b.py']"}])
    assert reply.choices[0].message.content


def test_required_tool_calls_name_given_tools_and_finish_as_tool_calls(served):
    client = served[0]
    answer = client.chat.completions.create(model="demo", messages=ASK, tools=TOOLS, tool_choice="required",
                                            parallel_tool_calls=False, max_tokens=60, temperature=0)
    assert answer.choices[0].finish_reason == "tool_calls"
    [call] = answer.choices[0].message.tool_calls
    tool = next(t for t in TOOLS if t["function"]["name"] == call.function.name)
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])


def _streamed_chat(client, **fields) -> tuple[str, dict, str | None]:
    """(content, {index: (name, arguments)}, finish reason) of a streamed chat answer."""
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(model="demo", stream=True, **fields):
        delta, finish = chunk.choices[0].delta, chunk.choices[0].finish_reason or finish
        content += delta.content or ""
        for piece in delta.tool_calls or []:
            name, arguments = calls.get(piece.index, (None, ""))
            calls[piece.index] = (piece.function.name or name, arguments + (piece.function.arguments or ""))
    return content, calls, finish


def test_auto_tool_choice_answers_in_text_or_calls_in_the_hermes_format(served):
    client = served[0]
    asked = {"messages": ASK, "tools": TOOLS, "max_tokens": 60, "temperature": 0}  # tool_choice: auto, the default
    text = client.chat.completions.create(model="demo", **asked)
    assert text.choices[0].message.tool_calls is None and text.choices[0].message.content
    assert not text.choices[0].message.content.startswith("<")
    assert _streamed_chat(client, **asked)[:2] == (text.choices[0].message.content, {})
    # pulled towards "<", the model opens a call: the grammar writes it in full, held to the tool's schema
    opener = served[2].tokenizer("<tool_call>", add_special_tokens=False).input_ids[0]
    calling = {**asked, "parallel_tool_calls": False, "logit_bias": {str(opener): 100}}
    answer = client.chat.completions.create(model="demo", **calling)
    [call] = answer.choices[0].message.tool_calls
    assert answer.choices[0].finish_reason == "tool_calls" and answer.choices[0].message.content is None
    tool = next(t for t in TOOLS if t["function"]["name"] == call.function.name)
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
    assert _streamed_chat(client, **calling) == ("", {0: (call.function.name, call.function.arguments)}, "tool_calls")


def test_response_format_json_schema_through_the_openai_client(served):
    client = served[0]
    answer = client.chat.completions.create(model="demo", messages=ASK, max_tokens=60, temperature=0,
                                            response_format={"type": "json_schema",
                                                             "json_schema": {"name": "walk", "schema": WALK}})
    jsonschema.validate(json.loads(answer.choices[0].message.content), WALK)
    free = client.chat.completions.create(model="demo", messages=ASK, max_tokens=60, temperature=0)
    assert free.choices[0].message.content != answer.choices[0].message.content


@pytest.mark.parametrize("fields, needle", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "no tool is named"),
    ({"tool_choice": "required"}, "needs tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "one output constraint"),
    ({"structured_outputs": {"json": {"type": "bogus"}}}, "bogus"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "exactly one"),
    ({"structured_outputs": {"jsonn": {}}}, "jsonn"),
    ({"response_format": {"type": "json_schema"}}, "json_schema"),
])
def test_bad_tool_and_format_requests_are_a_400_naming_what_is_wrong(served, fields, needle):
    _, url, _, _ = served
    response = httpx.post(f"{url}/v1/chat/completions", headers=AUTH,
                          json={"model": "demo", "max_tokens": 4, "messages": ASK, **fields})
    assert response.status_code == 400, response.text
    assert needle in response.json()["error"]["message"]


@pytest.mark.parametrize("path, fields, status", [
    ("/v1/completions", {"use_beam_search": True}, 400), ("/v1/completions", {"use_beam_search": False}, 200),
    ("/v1/completions", {"include_stop_str_in_output": True}, 400), ("/v1/completions", {"suffix": "x"}, 400),
    ("/v1/completions", {"logits_processors": ["x"]}, 400), ("/v1/completions", {"skip_special_tokens": True}, 200),
    ("/v1/chat/completions", {"echo": True}, 400), ("/v1/chat/completions", {"continue_final_message": True}, 400),
    ("/v1/chat/completions", {"functions": [{"name": "f"}]}, 400), ("/v1/chat/completions", {"user": "me"}, 200),
    ("/v1/chat/completions", {"response_format": {"type": "structural_tag"}}, 400),
])
def test_a_known_field_that_is_not_served_is_a_400_never_a_silent_200(served, path, fields, status):
    _, url, _, _ = served
    body = {"model": "demo", "max_tokens": 4, **fields}
    body |= {"prompt": "x"} if path == "/v1/completions" else {"messages": ASK}
    response = httpx.post(f"{url}{path}", headers=AUTH, json=body)
    assert response.status_code == status, response.text
    if status == 400:
        assert next(iter(fields)) in response.json()["error"]["message"]


def test_tool_schemas_with_definitions_are_served_under_required_and_auto(served):
    """Parameters as pydantic writes them, pointing into their own $defs: the pointers still resolve once the
    calls of several tools share one schema."""
    client = served[0]
    point = {"type": "object", "properties": {"at": {"$ref": "#/$defs/Point"}}, "required": ["at"],
             "additionalProperties": False,
             "$defs": {"Point": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"],
                                 "additionalProperties": False}}}
    tools = [{"type": "function", "function": {"name": name, "parameters": point}} for name in ("go", "look")]
    answer = client.chat.completions.create(model="demo", messages=ASK, tools=tools, tool_choice="required",
                                            parallel_tool_calls=False, max_tokens=60, temperature=0)
    [call] = answer.choices[0].message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), point)
    text = client.chat.completions.create(model="demo", messages=ASK, tools=tools, max_tokens=8, temperature=0)
    assert text.choices[0].finish_reason in ("stop", "length")


def test_usage_counts_the_prompt_as_truncated(served):
    client = served[0]
    answer = client.completions.create(model="demo", prompt=PROMPT, max_tokens=4, temperature=0,
                                       extra_body={"truncate_prompt_tokens": 5})
    assert answer.usage.prompt_tokens == 5
    chat = client.chat.completions.create(model="demo", messages=ASK, max_tokens=4, temperature=0,
                                          extra_body={"truncate_prompt_tokens": 3})
    assert chat.usage.prompt_tokens == 3


def test_a_forced_call_cut_by_max_tokens_is_a_call_streamed_or_not(served):
    """As OpenAI answers at max_tokens: the call with its arguments cut short, finish 'length'."""
    client = served[0]
    asked = {"messages": ASK, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "walk"}},
             "max_tokens": 4, "temperature": 0}
    answer = client.chat.completions.create(model="demo", **asked)
    [call] = answer.choices[0].message.tool_calls
    assert answer.choices[0].finish_reason == "length" and call.function.name == "walk"
    assert '{"root": "'.startswith(call.function.arguments[:3]) and not call.function.arguments.endswith("}")
    assert _streamed_chat(client, **asked) == ("", {0: ("walk", call.function.arguments)}, "length")
