"""The official `openai` client (and `jsonschema`) against a running server: what agents and apps
use beyond plain chat.

Usage: python3 api_features.py BASE_URL serve|cluster

Both `serve` (one process) and `cluster` (`tessera up`: the last stage of the ring samples,
applying the grammar and reporting log-probabilities) check, in order: every parameter of the
client's own request schemas is honoured or refused with a 400 naming it; logprobs with
top_logprobs on chat and completions, streamed and not; n=3 (distinct, reproducible, choice 0
equal to n=1); presence/frequency penalties change the output; json_object and strict
json_schema output, validated with jsonschema, streamed equal to whole; tools with tool_choice
required, named and auto, streamed and not, parallel_tool_calls=false, and a tool round trip
(assistant tool_calls + tool result in the history); a `prediction` (predicted outputs), right or
wrong, changes no token or log-probability. The mode only labels the output.

Exits 0 when all pass; 3 when a package is missing (the Rust test decides whether that fails).
"""

import json
import sys
import urllib.error
import urllib.request

try:
    import jsonschema
    import openai
    from openai.types import completion_create_params
    from openai.types.chat import completion_create_params as chat_create_params
except ImportError as e:
    print(f"missing package: {e} (pip install openai jsonschema)", file=sys.stderr)
    sys.exit(3)

BASE, MODE = sys.argv[1].rstrip("/"), sys.argv[2]
client = openai.OpenAI(base_url=BASE + "/v1", api_key="not-needed", max_retries=0, timeout=120)
MODEL = client.models.list().data[0].id
MSGS = [{"role": "user", "content": "Tell me about a cat."}]

# A plausible value for each request parameter of the reference schemas (anything not listed
# gets "x": the server must then honour it or refuse it by name all the same).
VALUES = {
    "messages": MSGS,
    "prompt": "Once upon a time",
    "stream": False,
    "stream_options": None,
    "max_tokens": 4,
    "max_completion_tokens": 4,
    "temperature": 0.5,
    "top_p": 0.9,
    "seed": 3,
    "stop": ["\n\n"],
    "n": 2,
    "best_of": 2,
    "logprobs": True,
    "top_logprobs": 2,
    "logit_bias": {"5": 1.0},
    "presence_penalty": 0.5,
    "frequency_penalty": 0.5,
    "response_format": {"type": "json_object"},
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
    "tool_choice": "none",
    "parallel_tool_calls": True,
    "modalities": ["text"],
    "store": False,
    "user": "u",
    "metadata": {"k": "v"},
    "echo": True,
    "suffix": "!",
    "audio": {"voice": "alloy", "format": "wav"},
    "prediction": {"type": "content", "content": "x"},
    "reasoning_effort": "low",
    "verbosity": "low",
    "web_search_options": {},
    "functions": [{"name": "f"}],
    "function_call": "auto",
    "service_tier": "auto",
    "safety_identifier": "s",
    "prompt_cache_key": "k",
}


def post(url, body, headers=None):
    """(status, parsed JSON body) of a POST, errors included."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"content-type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def sweep(path, params_cls, required):
    """Every key of the client's TypedDict: 200, or a 400 whose error names it."""
    names = sorted(params_cls.__annotations__)
    assert len(names) > 10, names
    outcomes = {}
    for name in names:
        if name in required or name == "model":
            continue
        body = {"model": MODEL, "max_tokens": 4, **{r: VALUES[r] for r in required}}
        body[name] = VALUES.get(name, "x")
        if name == "top_logprobs":
            body["logprobs"] = True
        if name == "logprobs" and path == "/completions":
            body["logprobs"] = 2
        if name == "best_of":
            body["n"] = 2
        if name == "echo":
            body.pop("logprobs", None)
        status, reply = post(BASE + "/v1" + path, body)
        if status == 200:
            outcomes[name] = "honoured/ignored"
        else:
            err = reply["error"]
            assert status == 400, (name, status, err)
            assert err["param"] == name, (name, err)
            outcomes[name] = "refused: " + err["message"]
    print(f"{path}: {len(outcomes)} parameters")
    for k, v in outcomes.items():
        print(f"  {k}: {v}")


def check_logprobs():
    whole = client.chat.completions.create(
        model=MODEL, messages=MSGS, temperature=0, max_tokens=12, logprobs=True, top_logprobs=3
    )
    c = whole.choices[0]
    lps = c.logprobs.content
    assert len(lps) == whole.usage.completion_tokens, (len(lps), whole.usage)
    for t in lps:
        assert t.logprob <= 0 and len(t.top_logprobs) == 3, t
        # Greedy: the chosen token is the most likely one.
        assert t.top_logprobs[0].token == t.token, t
        assert abs(t.top_logprobs[0].logprob - t.logprob) < 1e-6, t
        assert bytes(t.bytes).decode("utf-8", "replace") == t.token or t.bytes == [], t
    assert "".join(t.token for t in lps).strip() == c.message.content.strip()
    stream = client.chat.completions.create(
        model=MODEL, messages=MSGS, temperature=0, max_tokens=12, logprobs=True,
        top_logprobs=3, stream=True,
    )
    streamed = [t for ch in stream for cc in ch.choices if cc.logprobs for t in cc.logprobs.content]
    assert [(t.token, t.logprob) for t in streamed] == [(t.token, t.logprob) for t in lps]
    comp = client.completions.create(
        model=MODEL, prompt="Once upon a time", temperature=0, max_tokens=8, logprobs=2
    )
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 8, lp
    assert all(len(t) <= 2 for t in lp.top_logprobs), lp
    assert "".join(lp.tokens) == comp.choices[0].text
    print(f"logprobs: {[(t.token, round(t.logprob, 3)) for t in lps[:4]]} ...")


def check_n():
    kw = dict(model=MODEL, messages=MSGS, temperature=1.0, max_tokens=24, seed=5)
    a = client.chat.completions.create(n=3, **kw)
    b = client.chat.completions.create(n=3, **kw)
    one = client.chat.completions.create(n=1, **kw)
    texts = [c.message.content for c in a.choices]
    assert [c.index for c in a.choices] == [0, 1, 2], a
    assert len(set(texts)) > 1, f"choices are not distinct: {texts}"
    assert texts == [c.message.content for c in b.choices], "same seed, different choices"
    assert texts[0] == one.choices[0].message.content, "choice 0 differs from n=1"
    stream = client.chat.completions.create(n=3, stream=True, **kw)
    parts = {0: "", 1: "", 2: ""}
    for ch in stream:
        for c in ch.choices:
            parts[c.index] += c.delta.content or ""
    assert [parts[i] for i in range(3)] == texts, (parts, texts)
    print(f"n=3: {[t[:30] for t in texts]}")


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pet": {"type": "string", "enum": ["cat", "dog", "bird"]},
        "happy": {"type": "boolean"},
    },
    "required": ["name", "age", "pet", "happy"],
    "additionalProperties": False,
}


def check_json():
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    whole = client.chat.completions.create(
        model=MODEL, messages=MSGS, temperature=0, max_tokens=120, response_format=rf
    )
    text = whole.choices[0].message.content
    value = json.loads(text)
    jsonschema.validate(value, SCHEMA)
    assert whole.choices[0].finish_reason == "stop", whole.choices[0]
    stream = client.chat.completions.create(
        model=MODEL, messages=MSGS, temperature=0, max_tokens=120, response_format=rf, stream=True
    )
    streamed = "".join(c.delta.content or "" for ch in stream for c in ch.choices)
    assert streamed == text, (streamed, text)
    sampled = client.chat.completions.create(
        model=MODEL, messages=MSGS, temperature=1, seed=9, max_tokens=120, response_format=rf, n=3
    )
    for c in sampled.choices:
        jsonschema.validate(json.loads(c.message.content), SCHEMA)
    obj = client.chat.completions.create(
        model=MODEL, messages=MSGS, temperature=0, max_tokens=60,
        response_format={"type": "json_object"},
    )
    o = obj.choices[0]
    if o.finish_reason == "stop":
        assert isinstance(json.loads(o.message.content), dict), o.message.content
    print(f"json_schema: {text}")


# Small schemas: the built-in model's context is 512 tokens and its vocabulary spells JSON
# almost byte by byte.
WEATHER = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"enum": [1, 2, 3]}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
        "required": ["zone"], "additionalProperties": False}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def valid_calls(calls):
    assert calls, "no tool call"
    for c in calls:
        assert c.type == "function" and c.id, c
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])


def streamed_calls(**kw):
    calls, finish = {}, None
    for ch in client.chat.completions.create(stream=True, **kw):
        for c in ch.choices:
            finish = c.finish_reason or finish
            for d in c.delta.tool_calls or []:
                slot = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                if d.id:
                    assert slot["id"] in (None, d.id), (slot, d)
                    slot["id"] = d.id
                if d.function and d.function.name:
                    slot["name"] += d.function.name
                if d.function and d.function.arguments:
                    slot["arguments"] += d.function.arguments
    return [calls[i] for i in sorted(calls)], finish


def check_tools():
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    kw = dict(model=MODEL, messages=msgs, temperature=0, max_tokens=200, tools=TOOLS)
    r = client.chat.completions.create(tool_choice="required", **kw)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls", c
    valid_calls(c.message.tool_calls)
    s_calls, s_finish = streamed_calls(tool_choice="required", **kw)
    assert s_finish == "tool_calls", s_finish
    assert [(x["name"], json.loads(x["arguments"])) for x in s_calls] == [
        (t.function.name, json.loads(t.function.arguments)) for t in c.message.tool_calls
    ]
    assert all(x["id"] for x in s_calls), s_calls
    named = client.chat.completions.create(
        tool_choice={"type": "function", "function": {"name": "get_time"}}, **kw
    )
    nc = named.choices[0].message.tool_calls
    valid_calls(nc)
    assert {t.function.name for t in nc} == {"get_time"}, nc
    single = client.chat.completions.create(
        tool_choice="required", parallel_tool_calls=False, **kw
    )
    assert len(single.choices[0].message.tool_calls) == 1, single
    print(f"tools required: {[(t.function.name, t.function.arguments) for t in c.message.tool_calls]}")
    check_tools_auto(kw)


def check_tools_auto(kw):
    """auto: a reply is text or valid calls; a round trip with a tool result is accepted."""
    auto = client.chat.completions.create(tool_choice="auto", **kw)
    a = auto.choices[0]
    if a.message.tool_calls:
        valid_calls(a.message.tool_calls)
        assert a.finish_reason == "tool_calls"
    else:
        assert a.finish_reason in ("stop", "length") and a.message.content is not None
    calls, finish = streamed_calls(tool_choice="auto", **kw)
    assert (finish == "tool_calls") == bool(calls), (finish, calls)
    history = kw["messages"] + [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"forecast": "sunny"}'},
    ]
    rt = client.chat.completions.create(**{**kw, "messages": history})
    assert rt.choices[0].finish_reason in ("stop", "length", "tool_calls"), rt
    print(f"tools auto: {a.finish_reason}; round trip: {rt.choices[0].finish_reason}")


def check_penalties():
    pen = client.chat.completions.create(
        model=MODEL, messages=MSGS, temperature=0, max_tokens=24, frequency_penalty=2.0,
        presence_penalty=2.0,
    )
    plain = client.chat.completions.create(model=MODEL, messages=MSGS, temperature=0, max_tokens=24)
    assert pen.choices[0].message.content != plain.choices[0].message.content, "penalties ignored"


def check_prediction():
    """Predicted outputs: the answer's own text predicted, or a wrong text, changes no token or
    log-probability, whole and streamed."""
    kw = dict(model=MODEL, messages=MSGS, temperature=0, max_tokens=24, logprobs=True,
              top_logprobs=2)
    plain = client.chat.completions.create(**kw).choices[0]
    lps = [(t.token, t.logprob) for t in plain.logprobs.content]
    for p in [plain.message.content, "A dog ran down to the sea and back."]:
        got = client.chat.completions.create(
            **kw, prediction={"type": "content", "content": p}
        ).choices[0]
        assert got.message.content == plain.message.content, (p, got.message.content)
        assert [(t.token, t.logprob) for t in got.logprobs.content] == lps, p
        streamed = "".join(
            c.choices[0].delta.content or ""
            for c in client.chat.completions.create(
                **kw, stream=True, prediction={"type": "content", "content": p}
            )
            if c.choices
        )
        assert streamed == plain.message.content, (p, streamed)
    print("prediction: the same answer with the right and a wrong prediction")


def main():
    sweep("/chat/completions", chat_create_params.CompletionCreateParamsBase, ["messages"])
    sweep("/completions", completion_create_params.CompletionCreateParamsBase, ["prompt"])
    check_logprobs()
    check_n()
    check_penalties()
    check_json()
    check_tools()
    check_prediction()
    print(f"api features ({MODE}): all checks passed")


if __name__ == "__main__":
    main()
