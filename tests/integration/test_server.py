"""A real uvicorn server on loopback, driven by the official `openai` client."""

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from draftsmith.cli import main
from draftsmith.serve import LLM, SamplingParams
from draftsmith.serve.openai.cli import build_server_app, free_port, server_in_thread
from helpers import DEMO_MODEL, make_speculation_pay

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}  # every route but /health needs it
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
PROMPTS = ["def add(a, b):\n    return a", "import os\n\n\ndef walk(root):\n    for dirpath, dirs, files in os.wa",
           "class Stack:\n    def push(self, item):\n        self.it", "for i in ra"]


@pytest.fixture(scope="module")
def server():
    llm = LLM(DEMO_MODEL, dtype="float32", device="cpu", max_num_seqs=4, max_model_len=256, speculative_config=SPEC)
    make_speculation_pay(llm)  # the metric tests need drafts to happen whatever this machine's speed
    app = build_server_app(llm, "demo", api_key=KEY, max_queue=64)
    with server_in_thread(app) as url:
        yield url, llm


def _client(url, **kw):
    return openai.OpenAI(base_url=f"{url}/v1", api_key=kw.pop("api_key", KEY), max_retries=0, timeout=120, **kw)


def _metrics(url):
    text = httpx.get(f"{url}/metrics", headers=AUTH).text
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name")))] = s.value
    return samples


def test_completions_and_chat_streamed_equal_non_streamed(server):
    url, _ = server
    client = _client(url)
    for prompt in PROMPTS[:2]:
        full = client.completions.create(model="demo", prompt=prompt, max_tokens=40, temperature=0)
        chunks = list(client.completions.create(model="demo", prompt=prompt, max_tokens=40, temperature=0,
                                                stream=True, stream_options={"include_usage": True}))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
        assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens > 0
        assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens
        assert full.choices[0].finish_reason in ("stop", "length")
    messages = [{"role": "user", "content": "Write a Python function that reverses a list."}]
    chat = client.chat.completions.create(model="demo", messages=messages, max_tokens=30, temperature=0)
    streamed = list(client.chat.completions.create(model="demo", messages=messages, max_tokens=30, temperature=0,
                                                   stream=True))
    assert streamed[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == chat.choices[0].message.content
    assert streamed[-1].choices[0].finish_reason == chat.choices[0].finish_reason
    assert chat.usage.completion_tokens > 0


def test_logprobs_with_speculation_equal_plain_decoding_streamed_or_not(server):
    """The server speculates (n-gram, drafts forced): its logprobs, in both OpenAI shapes, streamed and not,
    equal those of a plain engine's offline run of the same greedy requests."""
    url, llm = server
    client = _client(url)
    drafts_before = llm.get_metrics()["num_accepted_tokens"]
    plain = LLM(DEMO_MODEL, dtype="float32", device="cpu", max_num_seqs=1, max_model_len=256)
    prompt = PROMPTS[1]
    want = plain.generate([prompt], SamplingParams(temperature=0, max_tokens=40, logprobs=2), use_tqdm=False)[0]
    want = want.outputs[0].logprobs
    decode = [plain.tokenizer.decode([next(iter(entry))]) for entry in want]

    full = client.completions.create(model="demo", prompt=prompt, max_tokens=40, temperature=0, logprobs=2)
    got = full.choices[0].logprobs
    assert got.tokens == decode and "".join(got.tokens) == full.choices[0].text
    assert got.text_offset == [sum(map(len, decode[:i])) for i in range(len(decode))]
    for value, top, entry in zip(got.token_logprobs, got.top_logprobs, want):
        assert value == pytest.approx(next(iter(entry.values())).logprob, abs=5e-5)
        assert len(top) == len(entry) and max(top.values()) == pytest.approx(value, abs=5e-5)  # greedy: the top
    chunks = list(client.completions.create(model="demo", prompt=prompt, max_tokens=40, temperature=0, logprobs=2,
                                            stream=True))
    assert [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens] == got.tokens
    assert [o for c in chunks if c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset] == got.text_offset

    messages = [{"role": "user", "content": "def add(a, b):"}]
    chat = client.chat.completions.create(model="demo", messages=messages, max_tokens=30, temperature=0,
                                          logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert "".join(item.token for item in content) == chat.choices[0].message.content
    for item in content:
        assert [alt.logprob for alt in item.top_logprobs] == sorted((alt.logprob for alt in item.top_logprobs),
                                                                    reverse=True)
        assert len(item.top_logprobs) == 2 and item.top_logprobs[0].token == item.token  # greedy: rank 1
        assert bytes(item.bytes).decode(errors="replace") == item.token
    streamed = list(client.chat.completions.create(model="demo", messages=messages, max_tokens=30, temperature=0,
                                                   logprobs=True, top_logprobs=2, stream=True))
    tokens = [item for c in streamed if c.choices[0].logprobs for item in c.choices[0].logprobs.content]
    assert [i.token for i in tokens] == [i.token for i in content]
    assert [i.logprob for i in tokens] == pytest.approx([i.logprob for i in content], abs=5e-5)
    assert llm.get_metrics()["num_accepted_tokens"] > drafts_before  # the server really speculated
    no_logprobs = client.completions.create(model="demo", prompt=prompt, max_tokens=4, temperature=0)
    assert no_logprobs.choices[0].logprobs is None


def test_lm_eval_loglikelihood_request_echoes_prompt_logprobs(server):
    """What lm-evaluation-harness' local-completions sends for loglikelihood tasks: a batch of token-id
    prompts, max_tokens 1, logprobs 1, echo. Each choice holds the prompt's text and logprobs (the first
    token's is None) and the one generated token's, in prompt order; they equal an offline plain run's."""
    url, _ = server
    plain = LLM(DEMO_MODEL, dtype="float32", device="cpu", max_num_seqs=2, max_model_len=256)
    batch = [plain.tokenizer(p, add_special_tokens=False).input_ids for p in PROMPTS[:3]]
    response = httpx.post(f"{url}/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=120, json={
        "model": "demo", "prompt": batch, "max_tokens": 1, "logprobs": 1, "echo": True, "temperature": 0})
    assert response.status_code == 200, response.text
    body = response.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert body["usage"]["prompt_tokens"] == sum(map(len, batch)) and body["usage"]["completion_tokens"] == 3
    want = plain.generate([{"prompt_token_ids": ids} for ids in batch],
                          SamplingParams(temperature=0, max_tokens=1, logprobs=1, prompt_logprobs=1), use_tqdm=False)
    for ids, choice, reference in zip(batch, body["choices"], want):
        logprobs = choice["logprobs"]
        generated = reference.outputs[0]
        assert choice["text"] == plain.tokenizer.decode(ids) + generated.text
        assert len(logprobs["token_logprobs"]) == len(ids) + 1
        assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
        expected = [e[t].logprob for t, e in zip(ids[1:], reference.prompt_logprobs[1:])]
        expected.append(generated.logprobs[0][generated.token_ids[0]].logprob)
        assert logprobs["token_logprobs"][1:] == pytest.approx(expected, abs=5e-5)
        # lm-eval's greedy check: a token is greedy when its logprob is the largest in its top_logprobs
        greedy = [tok == max(top.values()) for tok, top in zip(logprobs["token_logprobs"][1:], logprobs["top_logprobs"][1:])]
        assert greedy == [e[t].rank == 1 for t, e in zip(ids[1:] + generated.token_ids,
                                                          reference.prompt_logprobs[1:] + generated.logprobs)]
    bad = httpx.post(f"{url}/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, json={
        "model": "demo", "prompt": [batch[0], [1] * 300], "max_tokens": 1})
    assert bad.status_code == 400 and "prompt 1" in bad.json()["error"]["message"]


def test_n_seeded_samples_one_choice_each_streamed_or_not(server):
    """n=3 with a seed: three different samples, indexed 0..2, the same again for the same request and in its
    stream (each chunk one sample's); greedy n=2 gives the greedy answer twice; chat returns n choices."""
    url, llm = server
    client = _client(url)
    prompt, ask = PROMPTS[1], {"model": "demo", "max_tokens": 16, "temperature": 0.9, "seed": 5, "n": 3,
                               "extra_body": {"ignore_eos": True}}
    before = llm.get_metrics()["num_prompt_tokens"]
    first = client.completions.create(prompt=prompt, **ask)
    assert llm.get_metrics()["num_prompt_tokens"] - before == first.usage.prompt_tokens  # one prefill for three
    assert [c.index for c in first.choices] == [0, 1, 2]
    texts = [c.text for c in first.choices]
    assert len(set(texts)) > 1
    assert first.usage.completion_tokens == 3 * 16  # every sample's tokens (ignore_eos: 16 each)
    assert [c.text for c in client.completions.create(prompt=prompt, **ask).choices] == texts
    streamed = ["", "", ""]
    finishes = {}
    for chunk in client.completions.create(prompt=prompt, stream=True, **ask):
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert streamed == texts and sorted(finishes) == [0, 1, 2]

    greedy = client.completions.create(model="demo", prompt=prompt, max_tokens=16, temperature=0)
    pair = client.completions.create(model="demo", prompt=[prompt, PROMPTS[0]], max_tokens=16, temperature=0, n=2)
    assert [c.index for c in pair.choices] == [0, 1, 2, 3]
    assert [c.text for c in pair.choices[:2]] == [greedy.choices[0].text] * 2
    messages = [{"role": "user", "content": "Write a Python function that reverses a list."}]
    chat = client.chat.completions.create(model="demo", messages=messages, max_tokens=12, temperature=0.9, seed=1,
                                          n=2)
    assert [c.index for c in chat.choices] == [0, 1] and all(c.message.content for c in chat.choices)
    chunks = list(client.chat.completions.create(model="demo", messages=messages, max_tokens=12, temperature=0.9,
                                                 seed=1, n=2, stream=True))
    roles = [c.choices[0].index for c in chunks if c.choices and c.choices[0].delta.role == "assistant"]
    assert roles == [0, 1]
    content = ["", ""]
    for c in chunks:
        for choice in c.choices:
            content[choice.index] += choice.delta.content or ""
    assert content == [c.message.content for c in chat.choices]
    assert not llm.engine.has_unfinished_requests() and not llm.engine.groups


def test_tokenize_and_detokenize_in_vllms_shapes(server):
    url, llm = server
    text = PROMPTS[0]
    tokens = httpx.post(f"{url}/tokenize", json={"model": "demo", "prompt": text}, headers=AUTH).json()
    assert tokens["tokens"] == llm.tokenizer(text).input_ids and tokens["count"] == len(tokens["tokens"])
    assert tokens["max_model_len"] == 256
    assert httpx.post(f"{url}/detokenize", json={"tokens": tokens["tokens"]}, headers=AUTH).json() == {
        "prompt": llm.tokenizer.decode(tokens["tokens"])}
    messages = [{"role": "user", "content": "hi"}]
    chat = httpx.post(f"{url}/tokenize", json={"messages": messages}, headers=AUTH).json()
    assert chat["tokens"] == llm.encode(llm.apply_chat_template(messages))[1]
    for path, body, needle in (("/tokenize", {}, "either prompt or messages"),
                               ("/detokenize", {"tokens": [10**6]}, "vocabulary size"),
                               ("/tokenize", {"model": "nope", "prompt": "x"}, "does not exist")):
        response = httpx.post(f"{url}{path}", json=body, headers=AUTH)
        assert response.status_code in (400, 404) and needle in response.json()["error"]["message"]


def test_echo_streams_the_prompt_first(server):
    url, _ = server
    client = _client(url)
    kwargs = dict(model="demo", prompt=PROMPTS[0], max_tokens=12, temperature=0, echo=True, logprobs=1)
    full = client.completions.create(**kwargs)
    chunks = list(client.completions.create(**kwargs, stream=True))
    assert chunks[0].choices[0].text == PROMPTS[0] and full.choices[0].text.startswith(PROMPTS[0])
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    streamed = [lp for c in chunks if c.choices[0].logprobs for lp in c.choices[0].logprobs.token_logprobs]
    assert streamed[0] is None and full.choices[0].logprobs.token_logprobs[0] is None
    assert streamed[1:] == pytest.approx(full.choices[0].logprobs.token_logprobs[1:], abs=5e-5)
    offsets = [o for c in chunks if c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
    assert offsets == full.choices[0].logprobs.text_offset


def test_stop_strings_stream_the_same_text(server):
    url, _ = server
    client = _client(url)
    kwargs = dict(model="demo", prompt=PROMPTS[1], max_tokens=60, temperature=0, stop=["\n    ", "):"])
    full = client.completions.create(**kwargs)
    streamed = "".join(c.choices[0].text for c in client.completions.create(**kwargs, stream=True))
    assert streamed == full.choices[0].text and full.choices[0].finish_reason == "stop"


def test_greedy_answers_equal_draftsmith_generate(server, tmp_path):
    url, _ = server
    prompts_file = tmp_path / "p.jsonl"
    prompts_file.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    assert main(["generate", "--model", str(DEMO_MODEL), "--prompts", str(prompts_file), "--output",
                 str(tmp_path / "o.jsonl"), "--max-tokens", "32", "--temperature", "0", "--device", "cpu"]) == 0
    expected = [json.loads(line)["text"] for line in (tmp_path / "o.jsonl").read_text().splitlines()]
    client = _client(url)
    got = [client.completions.create(model="demo", prompt=p, max_tokens=32, temperature=0).choices[0].text
           for p in PROMPTS]
    assert got == expected


def test_32_concurrent_requests_with_cancellations(server):
    url, llm = server
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=300)
    before = _metrics(url)

    async def one(i):
        prompt, n = PROMPTS[i % 4], 8 + (i * 5) % 40
        extra = {"ignore_eos": True}
        if i % 8 == 7:  # cancelled midway: read two chunks, then drop the stream
            stream = await client.completions.create(model="demo", prompt=prompt, max_tokens=200, temperature=0,
                                                     stream=True, extra_body=extra)
            seen = 0
            async for _ in stream:
                seen += 1
                if seen == 2:
                    break
            await stream.close()
            return None
        if i % 2:
            stream = await client.completions.create(model="demo", prompt=prompt, max_tokens=n, temperature=0,
                                                     stream=True, extra_body=extra,
                                                     stream_options={"include_usage": True})
            chunks = [c async for c in stream]
            return i, "".join(c.choices[0].text for c in chunks if c.choices), chunks[-1].usage.completion_tokens
        r = await client.completions.create(model="demo", prompt=prompt, max_tokens=n, temperature=0, extra_body=extra)
        return i, r.choices[0].text, r.usage.completion_tokens

    async def run_all():
        async with client:
            return await asyncio.gather(*(one(i) for i in range(32)))

    results = [r for r in asyncio.run(run_all()) if r is not None]
    assert len(results) == 28
    reference = {}
    for i, text, n_tokens in results:
        assert n_tokens == 8 + (i * 5) % 40
        key = (i % 4, n_tokens)
        reference.setdefault(key, text)
        assert text == reference[key]  # same prompt and length: same greedy text, streamed or not
    deadline = time.monotonic() + 10
    while llm.engine.has_unfinished_requests() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not llm.engine.has_unfinished_requests()  # cancelled requests were aborted, slots freed
    assert sorted(llm.engine.free_slots) == [0, 1, 2, 3]
    assert httpx.get(f"{url}/health").status_code == 200
    drafts = ("draftsmith:spec_decode_num_drafts_total", ())
    after = _metrics(url)
    # the engine's counters reach /metrics with its loop's report on going idle, a moment after the last
    # request finished: waited for, not read once
    while after[drafts] == before[drafts] and time.monotonic() < deadline + 10:
        time.sleep(0.05)
        after = _metrics(url)
    done = ("draftsmith:request_success_total", (("finished_reason", "length"),))
    assert after[done] - before.get(done, 0) == 28
    assert after[drafts] > before[drafts]


def test_non_streamed_client_disconnect_frees_the_request(server):
    url, llm = server
    body = {"model": "demo", "prompt": PROMPTS[0], "max_tokens": 250, "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=0.3)
    deadline = time.monotonic() + 10
    while llm.engine.has_unfinished_requests() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("case,status,needle", [
    ("unknown_model", 404, "`nope` does not exist"),
    ("bad_temperature", 400, "temperature"),
    ("missing_prompt", 400, "prompt"),
    ("n5", 400, "n=5 samples run at once, one cache slot each, but max_num_seqs is 4"),
    ("too_long", 400, "max_model_len"),
    ("bad_json", 400, "not valid JSON"),
    ("wrong_key", 401, "API key"),
    ("no_key", 401, "API key"),
    ("empty_messages", 400, "messages"),
    ("too_many_logprobs", 400, "logprobs"),
    ("top_logprobs_alone", 400, "top_logprobs: needs logprobs"),
    ("prompt_list_streamed", 400, "stream one prompt per request"),
    ("best_of", 400, "best_of: only best_of=n"),
])
def test_bad_requests_get_openai_errors(server, case, status, needle):
    url, _ = server
    headers = {"Authorization": f"Bearer {KEY}"}
    path, body = "/v1/completions", {"model": "demo", "prompt": "x", "max_tokens": 4}
    if case == "unknown_model":
        body["model"] = "nope"
    elif case == "bad_temperature":
        body["temperature"] = -1
    elif case == "missing_prompt":
        del body["prompt"]
    elif case == "n5":
        body["n"] = 5
    elif case == "too_long":
        body["prompt"] = "x = 1\n" * 200
    elif case == "wrong_key":
        headers = {"Authorization": "Bearer nope"}
    elif case == "no_key":
        headers = {}
    elif case == "empty_messages":
        path, body = "/v1/chat/completions", {"model": "demo", "messages": []}
    elif case == "best_of":
        body["best_of"] = 3
    elif case == "prompt_list_streamed":
        body.update(prompt=["x", "y"], stream=True)
    elif case == "too_many_logprobs":
        body["logprobs"] = 21
    elif case == "top_logprobs_alone":
        path, body = "/v1/chat/completions", {"model": "demo", "messages": [{"role": "user", "content": "x"}],
                                              "top_logprobs": 2}
    if case == "bad_json":
        response = httpx.post(f"{url}{path}", content=b"{oops", headers={**headers, "content-type": "application/json"})
    else:
        response = httpx.post(f"{url}{path}", json=body, headers=headers)
    assert response.status_code == status
    error = response.json()["error"]
    assert needle in error["message"] and error["code"] == status and error["type"]


def test_openai_client_sees_typed_errors(server):
    url, _ = server
    with pytest.raises(openai.NotFoundError):
        _client(url).completions.create(model="other", prompt="x", max_tokens=2)
    with pytest.raises(openai.AuthenticationError):
        _client(url, api_key="wrong").models.list()
    assert [m.id for m in _client(url).models.list().data] == ["demo"]
    assert httpx.get(f"{url}/version", headers=AUTH).json()["version"]


def test_full_queue_answers_503_at_once():
    llm = LLM(DEMO_MODEL, dtype="float32", device="cpu", max_num_seqs=1, max_model_len=512)
    app = build_server_app(llm, "demo", max_queue=1)
    with server_in_thread(app) as url:
        body = {"model": "demo", "prompt": PROMPTS[0], "max_tokens": 400, "temperature": 0, "ignore_eos": True}
        threads = [threading.Thread(target=httpx.post, args=(f"{url}/v1/completions",),
                                    kwargs={"json": body, "timeout": 120}) for _ in range(2)]
        for t in threads:
            t.start()
            time.sleep(0.3)  # the first takes the slot, the second waits
        deadline = time.monotonic() + 10
        while len(llm.engine.waiting) < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        start = time.monotonic()
        response = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
        assert response.status_code == 503 and "queue is full" in response.json()["error"]["message"]
        assert time.monotonic() - start < 2
        for t in threads:
            t.join()


def test_a_prompt_list_that_fills_the_queue_leaves_nothing_queued():
    """Prompts of a list queued before the queue filled are aborted with the 503, not left to run."""
    llm = LLM(DEMO_MODEL, dtype="float32", device="cpu", max_num_seqs=1, max_model_len=512)
    with server_in_thread(build_server_app(llm, "demo", max_queue=2)) as url:
        body = {"model": "demo", "prompt": PROMPTS, "max_tokens": 400, "temperature": 0, "ignore_eos": True}
        response = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
        assert response.status_code == 503 and "queue is full" in response.json()["error"]["message"]
        deadline = time.monotonic() + 30
        while llm.engine.has_unfinished_requests() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not llm.engine.has_unfinished_requests()
        assert llm.engine.stats["num_generated_tokens"] < 400  # aborted, not run to max_tokens


def test_metrics_parse_and_move(server):
    url, _ = server
    before = _metrics(url)
    _client(url).completions.create(model="demo", prompt=PROMPTS[2], max_tokens=16, temperature=0,
                                    extra_body={"ignore_eos": True})
    after = _metrics(url)
    assert after[("draftsmith:generation_tokens_total", ())] - before[("draftsmith:generation_tokens_total", ())] == 16
    assert after[("draftsmith:e2e_request_latency_seconds_count", ())] == before[
        ("draftsmith:e2e_request_latency_seconds_count", ())] + 1
    assert ("draftsmith:time_to_first_token_seconds_count", ()) in after
    assert ("draftsmith:inter_token_latency_seconds_count", ()) in after
    per_pos = [after[("draftsmith:spec_decode_num_accepted_tokens_per_pos_total", (("position", str(p)),))]
               for p in range(3)]
    assert sum(per_pos) == after[("draftsmith:spec_decode_num_accepted_tokens_total", ())]
    # the policy's choices: every decode step of the request counted once, by the draft limit it got
    chosen = {labels: v for (name, labels), v in after.items() if name == "draftsmith:spec_decode_chosen_k_total"}
    chosen_before = {labels: v for (name, labels), v in before.items() if name == "draftsmith:spec_decode_chosen_k_total"}
    steps = sum(chosen.values()) - sum(chosen_before.values())
    assert 0 < steps < 16  # at most one step per token, and the first token comes from prefill
    plain = (after[("draftsmith:spec_decode_steps_without_speculation_total", ())]
             - before.get(("draftsmith:spec_decode_steps_without_speculation_total", ()), 0))
    assert 0 <= plain <= steps


def test_sigterm_shuts_down_cleanly(tmp_path):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "draftsmith", "serve", str(DEMO_MODEL), "--port", str(port),
                             "--device", "cpu", "--max-model-len", "512"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
            time.sleep(0.2)
        result = {}

        def request():
            body = {"model": str(DEMO_MODEL), "prompt": PROMPTS[0], "max_tokens": 60, "temperature": 0,
                    "ignore_eos": True}
            result["r"] = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60)

        t = threading.Thread(target=request)
        t.start()
        time.sleep(0.3)
        proc.send_signal(signal.SIGTERM)
        t.join(timeout=60)
        # uvicorn re-raises the captured SIGTERM after its graceful shutdown, so the exit status says so.
        assert proc.wait(timeout=60) in (0, -signal.SIGTERM)
        log = proc.stdout.read()
        assert "Application shutdown complete" in log and "Traceback" not in log, log
        assert result["r"].status_code == 200  # the in-flight request was finished, not dropped
        assert result["r"].json()["usage"]["completion_tokens"] == 60
    finally:
        if proc.poll() is None:
            proc.kill()
