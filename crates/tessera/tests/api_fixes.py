"""The API defects of issue 36, each shown fixed through the official clients.

Usage: python3 api_fixes.py BASE_URL ALLOWED_ORIGIN

- Parameters whose value asks for nothing are accepted (`include: []`, `reasoning: {}`,
  `truncation: "auto"`, `verbosity: "medium"`, `functions: []`, `max_tool_calls`), while a value
  that asks for something unhonoured is still a 400 naming it.
- llama.cpp's spellings (`n_predict`, `repeat_penalty`) act as the parameters they alias.
- The Responses object echoes its request's `tools`, `tool_choice` and `parallel_tool_calls`.
- A forced tool call cut by `max_tokens` comes back as a tool call or not at all, never as
  template text in content (chat, Anthropic, Responses).
- Anthropic assistant prefill, and `continue_final_message` on the OpenAI side, continue the
  turn: both give the same continuation, which differs from a fresh reply.
- CORS: a preflight from a loopback page or from ALLOWED_ORIGIN is answered, and their requests
  carry `Access-Control-Allow-Origin`; another origin's preflight is refused.

Exits 0 when all pass; 3 when a package is missing (the Rust test decides whether that fails).
"""

import http.client
import json
import sys
import urllib.parse

try:
    import anthropic
    import openai
except ImportError as e:
    print(f"missing package: {e} (pip install anthropic openai)", file=sys.stderr)
    sys.exit(3)

BASE, ALLOWED = sys.argv[1].rstrip("/"), sys.argv[2]
oai = openai.OpenAI(base_url=BASE + "/v1", api_key="not-needed", max_retries=0, timeout=120)
ant = anthropic.Anthropic(base_url=BASE, api_key="not-needed", max_retries=0, timeout=120)
MODEL = oai.models.list().data[0].id
MSGS = [{"role": "user", "content": "Tell me about a cat."}]
WEATHER = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"enum": [1, 2, 3]}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
FLAT_TOOLS = [{"type": "function", "name": "get_weather", "parameters": WEATHER}]


def refused(param, call):
    try:
        call()
    except openai.BadRequestError as e:
        assert e.body["param"] == param, e.body
        return
    raise AssertionError(f"{param} was accepted")


def check_nothing_asked():
    r = oai.responses.create(model=MODEL, input="Hi", max_output_tokens=4, temperature=0,
                             include=[], reasoning={}, truncation="auto", max_tool_calls=3)
    assert r.status in ("completed", "incomplete"), r
    c = oai.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=4, temperature=0,
                                    verbosity="medium", extra_body={"functions": []})
    assert c.choices[0].message.content, c
    refused("verbosity", lambda: oai.chat.completions.create(
        model=MODEL, messages=MSGS, max_tokens=4, verbosity="low"))
    refused("include", lambda: oai.responses.create(
        model=MODEL, input="Hi", max_output_tokens=4, include=["reasoning.encrypted_content"]))
    print("nothing asked: accepted; something unhonoured asked: refused by name")


def check_llama_cpp_spellings():
    plain = oai.completions.create(model=MODEL, prompt="Once upon a time", temperature=0,
                                   max_tokens=5)
    alias = oai.completions.create(model=MODEL, prompt="Once upon a time", temperature=0,
                                   extra_body={"n_predict": 5})
    assert alias.usage.completion_tokens == plain.usage.completion_tokens <= 5, (alias, plain)
    assert alias.choices[0].text == plain.choices[0].text
    ours = oai.chat.completions.create(model=MODEL, messages=MSGS, temperature=0, max_tokens=24,
                                       extra_body={"repetition_penalty": 1.8})
    theirs = oai.chat.completions.create(model=MODEL, messages=MSGS, temperature=0,
                                         max_tokens=24, extra_body={"repeat_penalty": 1.8})
    none = oai.chat.completions.create(model=MODEL, messages=MSGS, temperature=0, max_tokens=24)
    assert theirs.choices[0].message.content == ours.choices[0].message.content
    assert theirs.choices[0].message.content != none.choices[0].message.content, "ignored"
    print("llama.cpp spellings: n_predict, repeat_penalty honoured")


def check_responses_echo():
    r = oai.responses.create(model=MODEL, input="Weather in Rome?", tools=FLAT_TOOLS,
                             tool_choice="none", parallel_tool_calls=False,
                             max_output_tokens=4, temperature=0)
    assert [t.name for t in r.tools] == ["get_weather"], r.tools
    assert r.tool_choice == "none" and r.parallel_tool_calls is False, r
    assert r.temperature == 0 and r.max_output_tokens == 4, r
    print("responses echo: tools, tool_choice, parallel_tool_calls")


TEMPLATE_TEXT = ("<tool_call>", "</tool_call>", '"name"')


def no_template_text(text):
    assert not any(t in (text or "") for t in TEMPLATE_TEXT), text


def check_cut_tool_calls():
    kw = dict(model=MODEL, messages=MSGS, tools=CHAT_TOOLS, tool_choice="required",
              temperature=0)
    whole = oai.chat.completions.create(max_tokens=300, **kw)
    assert whole.choices[0].finish_reason == "tool_calls", whole
    # Cut a few tokens before the call closes: its name is complete, its arguments are not.
    late = oai.chat.completions.create(max_tokens=whole.usage.completion_tokens - 4, **kw)
    lc = late.choices[0]
    assert lc.finish_reason == "length", lc
    no_template_text(lc.message.content)
    assert [t.function.name for t in lc.message.tool_calls] == ["get_weather"], lc
    # Cut early: nothing of the call survives, and no template text either.
    c = oai.chat.completions.create(max_tokens=3, **kw)
    ch = c.choices[0]
    assert ch.finish_reason == "length", ch
    no_template_text(ch.message.content)
    assert all(t.function.name == "get_weather" for t in ch.message.tool_calls or []), ch
    streamed = ""
    for chunk in oai.chat.completions.create(model=MODEL, messages=MSGS, tools=CHAT_TOOLS,
                                             tool_choice="required", max_tokens=12,
                                             temperature=0, stream=True):
        for x in chunk.choices:
            streamed += x.delta.content or ""
    no_template_text(streamed)
    m = ant.messages.create(model=MODEL, messages=MSGS, max_tokens=12,
                            tools=[{"name": "get_weather", "input_schema": WEATHER}],
                            tool_choice={"type": "any"}, extra_body={"temperature": 0})
    assert m.stop_reason == "max_tokens", m
    for b in m.content:
        if b.type == "text":
            no_template_text(b.text)
    r = oai.responses.create(model=MODEL, input="Weather in Rome?", tools=FLAT_TOOLS,
                             tool_choice="required", max_output_tokens=12, temperature=0)
    assert r.status == "incomplete", r
    for item in r.output:
        assert item.type == "function_call", item
    print(f"cut calls: late cut {lc.message.tool_calls[0].function.arguments!r}; no template text")


def check_prefill():
    begun = "Once upon a time, a cat named"
    m = ant.messages.create(model=MODEL, max_tokens=16, extra_body={"temperature": 0},
                            messages=MSGS + [{"role": "assistant", "content": begun}])
    cont = oai.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=16,
        messages=MSGS + [{"role": "assistant", "content": begun}],
        extra_body={"continue_final_message": True})
    fresh = oai.chat.completions.create(model=MODEL, messages=MSGS, temperature=0, max_tokens=16)
    text = "".join(b.text for b in m.content if b.type == "text")
    assert text == cont.choices[0].message.content, (text, cont)
    assert text != fresh.choices[0].message.content, "the prefill was not continued"
    # The turn continues: the prompt is the fresh one plus the begun text, not a closed turn.
    assert cont.usage.prompt_tokens > fresh.usage.prompt_tokens, (cont.usage, fresh.usage)
    refused("messages", lambda: oai.chat.completions.create(
        model=MODEL, messages=MSGS, max_tokens=4, extra_body={"continue_final_message": True}))
    print(f"prefill: {begun!r} + {text!r}")


def request(method, path, headers, body=None):
    u = urllib.parse.urlparse(BASE)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    conn.request(method, path, body=body, headers=headers)
    r = conn.getresponse()
    r.read()
    conn.close()
    return r


def check_cors():
    pre = {"Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "authorization, content-type"}
    for origin in ("http://localhost:3000", "http://127.0.0.1:5173", ALLOWED):
        r = request("OPTIONS", "/v1/chat/completions", {"Origin": origin, **pre})
        assert r.status == 204, (origin, r.status)
        assert r.getheader("Access-Control-Allow-Origin") == origin, r.getheaders()
        assert "POST" in r.getheader("Access-Control-Allow-Methods"), r.getheaders()
        assert "content-type" in r.getheader("Access-Control-Allow-Headers"), r.getheaders()
        body = json.dumps({"model": MODEL, "messages": MSGS, "max_tokens": 2})
        r = request("POST", "/v1/chat/completions",
                    {"Origin": origin, "Content-Type": "application/json"}, body)
        assert r.status == 200 and r.getheader("Access-Control-Allow-Origin") == origin, r.status
    r = request("OPTIONS", "/v1/chat/completions", {"Origin": "https://elsewhere.example", **pre})
    assert r.status == 403 and r.getheader("Access-Control-Allow-Origin") is None, r.status
    r = request("GET", "/v1/models", {"Origin": "https://elsewhere.example"})
    assert r.getheader("Access-Control-Allow-Origin") is None, r.getheaders()
    print(f"cors: loopback pages and {ALLOWED} allowed, others refused")


def main():
    check_nothing_asked()
    check_llama_cpp_spellings()
    check_responses_echo()
    check_cut_tool_calls()
    check_prefill()
    check_cors()
    print("api fixes: all checks passed")


if __name__ == "__main__":
    main()
