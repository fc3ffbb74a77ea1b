"""The official `anthropic` client against a running `tessera serve`: Messages, streamed
Messages, a tool-use round trip, count_tokens, every parameter of the client's request schema
honoured or refused by name, and the Responses API through the official `openai` client
(streamed and not, with a forced function call).

Usage: python3 anthropic_api.py BASE_URL

Exits 0 when all pass; 3 when a package is missing (the Rust test decides whether that fails).
"""

import json
import sys
import urllib.error
import urllib.request

try:
    import anthropic
    import jsonschema
    import openai
    from anthropic.types import message_create_params
except ImportError as e:
    print(f"missing package: {e} (pip install anthropic openai jsonschema)", file=sys.stderr)
    sys.exit(3)

BASE = sys.argv[1].rstrip("/")
client = anthropic.Anthropic(base_url=BASE, api_key="not-needed", max_retries=0, timeout=120)
oai = openai.OpenAI(base_url=BASE + "/v1", api_key="not-needed", max_retries=0, timeout=120)
MODEL = oai.models.list().data[0].id
MSGS = [{"role": "user", "content": "Tell me about a cat."}]
WEATHER = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"enum": [1, 2, 3]}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
# The client's create() has no temperature: greedy through the body, so runs compare.
T0 = {"temperature": 0}
TOOLS = [{"name": "get_weather", "description": "Weather forecast", "input_schema": WEATHER}]

VALUES = {
    "max_tokens": 4,
    "messages": MSGS,
    "model": MODEL,
    "system": "You are terse.",
    "stop_sequences": ["\n\n"],
    "stream": False,
    "temperature": 0.5,
    "top_p": 0.9,
    "top_k": 5,
    "tools": TOOLS,
    "tool_choice": {"type": "auto"},
    "metadata": {"user_id": "u"},
    "service_tier": "auto",
    "thinking": {"type": "enabled", "budget_tokens": 1024},
    "container": "c",
    "mcp_servers": [{"type": "url", "url": "http://x", "name": "x"}],
    "context_management": {"edits": []},
    "output_format": {"type": "json_schema", "schema": WEATHER},
    "output_config": {"format": {"type": "json_schema", "schema": WEATHER}},
    "cache_control": {"type": "ephemeral"},
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


def sweep():
    names = sorted(message_create_params.MessageCreateParamsBase.__annotations__)
    assert len(names) > 8, names
    for name in names:
        if name in ("model", "messages", "max_tokens"):
            continue
        body = {"model": MODEL, "max_tokens": 4, "messages": MSGS, name: VALUES.get(name, "x")}
        status, reply = post(BASE + "/v1/messages", body, {"anthropic-version": "2023-06-01"})
        if status == 200:
            print(f"  {name}: honoured/ignored")
        else:
            err = reply["error"]
            assert status == 400, (name, status, err)
            assert name in err["message"], (name, err)
            print(f"  {name}: refused: {err['message'][:90]}")


def check_messages():
    whole = client.messages.create(
        model=MODEL, max_tokens=32, system="You tell short stories.", messages=MSGS, extra_body=T0
    )
    assert whole.type == "message" and whole.role == "assistant", whole
    assert whole.content[0].type == "text" and whole.content[0].text, whole
    assert whole.stop_reason in ("end_turn", "max_tokens"), whole.stop_reason
    assert whole.usage.input_tokens > 0 and whole.usage.output_tokens > 0, whole.usage
    with client.messages.stream(
        model=MODEL, max_tokens=32, system="You tell short stories.", messages=MSGS, extra_body=T0
    ) as s:
        streamed = "".join(s.text_stream)
        final = s.get_final_message()
    assert streamed == whole.content[0].text, (streamed, whole.content[0].text)
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens
    print(f"message: {whole.content[0].text!r} ({whole.stop_reason})")
    check_stop_sequence(whole.content[0].text)


def check_stop_sequence(text):
    """A stop string from the middle of the greedy text ends the message just before it, and
    the message says so: `stop_reason` "stop_sequence" naming it, streamed and not."""
    k = len(text) // 2
    stop = text[k:k + 2]
    assert len(stop) == 2, text
    kw = dict(model=MODEL, max_tokens=32, system="You tell short stories.", messages=MSGS,
              extra_body=T0, stop_sequences=["never-generated-zzzz", stop])
    cut = client.messages.create(**kw)
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop, cut
    assert cut.content[0].text == text[:text.index(stop)], (cut.content[0].text, text, stop)
    with client.messages.stream(**kw) as s:
        streamed = "".join(s.text_stream)
        final = s.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == stop, final
    assert streamed == cut.content[0].text, (streamed, cut.content[0].text)
    print(f"stop sequence {stop!r}: {cut.content[0].text!r}")


def check_tools():
    first = client.messages.create(
        model=MODEL, max_tokens=160, messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=TOOLS, tool_choice={"type": "any"}, extra_body=T0,
    )
    assert first.stop_reason == "tool_use", first
    uses = [b for b in first.content if b.type == "tool_use"]
    assert uses and all(u.name == "get_weather" and u.id.startswith("toolu_") for u in uses), first
    for u in uses:
        jsonschema.validate(u.input, WEATHER)
    with client.messages.stream(
        model=MODEL, max_tokens=160, messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=TOOLS, tool_choice={"type": "tool", "name": "get_weather"}, extra_body=T0,
    ) as s:
        final = s.get_final_message()
    s_uses = [b for b in final.content if b.type == "tool_use"]
    assert final.stop_reason == "tool_use" and [u.input for u in s_uses] == [u.input for u in uses], final
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [u.model_dump() for u in uses]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": u.id, "content": "sunny, 21 C"} for u in uses]},
    ]
    second = client.messages.create(model=MODEL, max_tokens=40, messages=history, tools=TOOLS,
                                    extra_body=T0)
    assert second.stop_reason in ("end_turn", "max_tokens", "tool_use"), second
    print(f"tool use: {[u.input for u in uses]} then {second.stop_reason}")


def check_count_tokens():
    plain = client.messages.count_tokens(model=MODEL, messages=MSGS)
    with_tools = client.messages.count_tokens(model=MODEL, messages=MSGS, tools=TOOLS,
                                              system="You are terse.")
    whole = client.messages.create(model=MODEL, max_tokens=1, messages=MSGS)
    assert plain.input_tokens == whole.usage.input_tokens, (plain, whole.usage)
    assert with_tools.input_tokens > plain.input_tokens, (with_tools, plain)
    try:
        client.messages.create(model="claude-nope", max_tokens=4, messages=MSGS)
        raise AssertionError("unknown model accepted")
    except anthropic.NotFoundError:
        pass
    print(f"count_tokens: {plain.input_tokens} / with tools {with_tools.input_tokens}")


def check_responses():
    whole = oai.responses.create(model=MODEL, input="Tell me about a dog.",
                                 instructions="You tell short stories.", max_output_tokens=32,
                                 temperature=0)
    assert whole.output_text, whole
    events, text, done = [], "", None
    for ev in oai.responses.create(model=MODEL, input="Tell me about a dog.",
                                   instructions="You tell short stories.",
                                   max_output_tokens=32, temperature=0, stream=True):
        events.append(ev.type)
        if ev.type == "response.output_text.delta":
            text += ev.delta
        if ev.type in ("response.completed", "response.incomplete"):
            done = ev.response
    assert events[:2] == ["response.created", "response.in_progress"], events
    assert "response.output_item.added" in events and "response.output_text.done" in events, events
    assert text == whole.output_text and done.output_text == whole.output_text, (text, whole.output_text)
    tools = [{"type": "function", "name": "get_weather", "parameters": WEATHER}]
    call = oai.responses.create(model=MODEL, input="Weather in Rome?", tools=tools,
                                tool_choice="required", max_output_tokens=160, temperature=0)
    calls = [o for o in call.output if o.type == "function_call"]
    assert calls, call.output
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER)
    follow = oai.responses.create(model=MODEL, tools=tools, max_output_tokens=16, temperature=0, input=[
        {"role": "user", "content": "Weather in Rome?"},
        {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather",
         "arguments": calls[0].arguments},
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"},
    ])
    assert follow.status in ("completed", "incomplete"), follow
    try:
        oai.responses.create(model=MODEL, input="x", previous_response_id="resp_1")
        raise AssertionError("previous_response_id accepted by a stateless server")
    except openai.BadRequestError as e:
        assert e.body["param"] == "previous_response_id", e.body
    print(f"responses: {len(events)} events, call {calls[0].arguments}")


def main():
    print("/v1/messages parameters:")
    sweep()
    check_messages()
    check_tools()
    check_count_tokens()
    check_responses()
    print("anthropic + responses: all checks passed")


if __name__ == "__main__":
    main()
