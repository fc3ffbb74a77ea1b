"""The official `ollama` Python client against a running server's Ollama API.

Usage: python3 ollama_api.py BASE_URL serve|cluster

Checks, in order: list, show, ps and version describe the served model; chat and generate,
greedy, give the same text streamed (NDJSON, every line but the last `done: false`) as whole,
and chat gives the text `/v1/chat/completions` gives for the same request; `raw` generate skips
the template; `format` with a JSON schema and with "json" gives JSON (the schema validated);
tools: a reply is text or calls whose arguments are a mapping, and a history with a call and
its result is answered; an unknown model is 404 and an unhonoured option a 400 naming it.
The mode only labels the output. Embeddings are checked by `embeddings_api.py`.

Exits 0 when all pass; 3 when a package is missing (the Rust test decides whether that fails).
"""

import json
import sys
import urllib.request

try:
    import jsonschema
    import ollama
except ImportError as e:
    print(f"missing package: {e} (pip install ollama jsonschema)", file=sys.stderr)
    sys.exit(3)

BASE, MODE = sys.argv[1].rstrip("/"), sys.argv[2]
client = ollama.Client(host=BASE, timeout=120)
GREEDY = {"temperature": 0, "num_predict": 16}
MSGS = [{"role": "user", "content": "Tell me about a cat."}]


def get(path):
    with urllib.request.urlopen(BASE + path, timeout=60) as r:
        return json.loads(r.read())


def post(path, body):
    req = urllib.request.Request(
        BASE + path, data=json.dumps(body).encode(), headers={"content-type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def check_models():
    models = client.list().models
    assert len(models) == 1, models
    name = models[0].model
    assert name.endswith(":latest") or ":" in name, name
    shown = client.show(name)
    assert "completion" in shown.capabilities, shown
    assert shown.details.format == "gguf", shown
    running = client.ps().models
    assert running[0].model == name and running[0].context_length > 0, running
    assert get("/api/version")["version"], "no version"
    print(f"models: {name}, context {running[0].context_length}")
    return name


def check_chat(name):
    whole = client.chat(model=name, messages=MSGS, options=GREEDY, stream=False)
    assert whole.done and whole.done_reason in ("stop", "length"), whole
    assert whole.message.role == "assistant" and isinstance(whole.message.content, str), whole
    assert whole.prompt_eval_count > 0 and whole.eval_count > 0, whole
    assert whole.total_duration >= whole.eval_duration >= 0, whole
    parts = list(client.chat(model=name, messages=MSGS, options=GREEDY, stream=True))
    assert parts[-1].done and all(not p.done for p in parts[:-1]), parts
    assert len(parts) >= min(3, whole.eval_count + 1), "not streamed"
    streamed = "".join(p.message.content or "" for p in parts)
    assert streamed == whole.message.content, (streamed, whole.message.content)
    assert parts[-1].eval_count == whole.eval_count, (parts[-1], whole)
    # The same request through the OpenAI API: the same generation path, the same text.
    model_id = name.removesuffix(":latest")
    oa = post("/v1/chat/completions", {"model": model_id, "messages": MSGS, "temperature": 0,
                                       "max_tokens": 16})
    assert oa["choices"][0]["message"]["content"] == whole.message.content, oa
    # The bare name answers too; an empty conversation only "loads" the model.
    assert client.chat(model=model_id, messages=MSGS, options=GREEDY).message.content == streamed
    loaded = client.chat(model=name, messages=[])
    assert loaded.done and loaded.done_reason == "load", loaded
    print(f"chat: {whole.message.content!r} ({whole.done_reason})")


def check_generate(name):
    prompt = "Once upon a time"
    whole = client.generate(model=name, prompt=prompt, options=GREEDY, stream=False)
    assert whole.done and whole.response, whole
    parts = list(client.generate(model=name, prompt=prompt, options=GREEDY, stream=True))
    assert parts[-1].done and "".join(p.response for p in parts) == whole.response, parts
    raw = client.generate(model=name, prompt=prompt, options=GREEDY, raw=True)
    assert raw.prompt_eval_count < whole.prompt_eval_count, (raw, whole)
    oa = post("/v1/completions", {"model": name.removesuffix(":latest"), "prompt": prompt,
                                  "temperature": 0, "max_tokens": 16})
    assert oa["choices"][0]["text"] == raw.response, (oa, raw.response)
    print(f"generate: {whole.response!r}; raw: {raw.response!r}")


PET = {
    "type": "object",
    "properties": {"name": {"enum": ["Tom", "Kit"]}, "legs": {"enum": [3, 4]}},
    "required": ["name", "legs"],
    "additionalProperties": False,
}


def check_format(name):
    r = client.chat(model=name, messages=MSGS, format=PET, options={"temperature": 0,
                                                                    "num_predict": 200})
    assert r.done_reason == "stop", r
    jsonschema.validate(json.loads(r.message.content), PET)
    streamed = "".join(
        p.message.content or ""
        for p in client.chat(model=name, messages=MSGS, format=PET, stream=True,
                             options={"temperature": 0, "num_predict": 200})
    )
    assert streamed == r.message.content, (streamed, r.message.content)
    g = client.generate(model=name, prompt="A pet:", format=PET, options={"temperature": 0.7,
                                                                         "seed": 5,
                                                                         "num_predict": 200})
    jsonschema.validate(json.loads(g.response), PET)
    j = client.chat(model=name, messages=MSGS, format="json", options={"temperature": 0,
                                                                       "num_predict": 60})
    if j.done_reason == "stop":
        assert isinstance(json.loads(j.message.content), dict), j.message.content
    print(f"format: {r.message.content}")


WEATHER = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"enum": [1, 2, 3]}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                           "parameters": WEATHER}}]


def check_tools(name):
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    opts = {"temperature": 0, "num_predict": 60}
    plain = client.chat(model=name, messages=msgs, options=opts)
    r = client.chat(model=name, messages=msgs, tools=TOOLS, options=opts)
    # The tools reach the prompt.
    assert r.prompt_eval_count > plain.prompt_eval_count, (r, plain)
    for c in r.message.tool_calls or []:
        assert c.function.name == "get_weather", c
        jsonschema.validate(dict(c.function.arguments), WEATHER)
    if not r.message.tool_calls:
        assert r.message.content is not None and r.done_reason in ("stop", "length"), r
    streamed = list(client.chat(model=name, messages=msgs, tools=TOOLS, options=opts,
                                stream=True))
    s_calls = [c for p in streamed for c in (p.message.tool_calls or [])]
    assert [c.function.name for c in s_calls] == [
        c.function.name for c in r.message.tool_calls or []], (s_calls, r)
    # A round trip: the call and its result in the history.
    history = msgs + [
        {"role": "assistant", "content": "", "tool_calls": [
            {"function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 1}}}]},
        {"role": "tool", "content": '{"forecast": "sunny"}', "tool_name": "get_weather"},
    ]
    rt = client.chat(model=name, messages=history, tools=TOOLS, options=opts)
    assert rt.done and rt.prompt_eval_count > r.prompt_eval_count, rt
    print(f"tools: {len(r.message.tool_calls or [])} calls; round trip: {rt.done_reason}")


def check_errors(name):
    try:
        client.chat(model="no-such-model", messages=MSGS)
        raise AssertionError("an unknown model was accepted")
    except ollama.ResponseError as e:
        assert e.status_code == 404 and "no-such-model" in e.error, e
    try:
        client.chat(model=name, messages=MSGS, options={"mirostat": 2})
        raise AssertionError("mirostat was accepted")
    except ollama.ResponseError as e:
        assert e.status_code == 400 and "mirostat" in e.error, e
    # Options that change no output, and keep_alive, are accepted.
    r = client.chat(model=name, messages=MSGS, keep_alive="10m",
                    options={**GREEDY, "num_ctx": 4096, "num_thread": 2, "mirostat": 0})
    assert r.done, r
    print("errors: 404, 400 naming the option")


def main():
    name = check_models()
    check_chat(name)
    check_generate(name)
    check_format(name)
    check_tools(name)
    check_errors(name)
    print(f"ollama api ({MODE}): all checks passed")


if __name__ == "__main__":
    main()
