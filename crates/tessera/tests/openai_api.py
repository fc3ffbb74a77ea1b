"""The official `openai` Python client against a running `tessera serve` / `tessera up`.

Usage: python3 openai_api.py BASE_URL [API_KEY]

Checks, in order: the model is listed; a chat completion; a streamed chat completion whose
concatenated text equals the non-streamed text at temperature 0; a legacy completion; and
OpenAI-shaped errors (400 for a malformed request, 404 for an unknown model). Exits 0 when all
pass; 3 when the `openai` package is missing (the Rust test decides whether that fails).
"""

import sys

try:
    import openai
except ImportError:
    print("the `openai` package is not installed (pip install openai)", file=sys.stderr)
    sys.exit(3)


def main() -> None:
    base = sys.argv[1].rstrip("/") + "/v1"
    key = sys.argv[2] if len(sys.argv) > 2 else "not-needed"
    client = openai.OpenAI(base_url=base, api_key=key, max_retries=0, timeout=60)

    models = client.models.list().data
    assert len(models) == 1, models
    model = models[0].id
    print(f"model: {model}")

    messages = [
        {"role": "system", "content": "You tell short stories."},
        {"role": "user", "content": "Tell me about a cat."},
    ]
    whole = client.chat.completions.create(
        model=model, messages=messages, temperature=0, max_tokens=48, seed=7
    )
    assert whole.object == "chat.completion", whole
    assert whole.id.startswith("chatcmpl-"), whole.id
    assert whole.model == model
    choice = whole.choices[0]
    assert choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length"), choice.finish_reason
    text = choice.message.content
    assert text, "empty completion"
    assert whole.usage.completion_tokens > 0
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens
    print(f"chat: {text!r} ({choice.finish_reason}, {whole.usage})")

    stream = client.chat.completions.create(
        model=model,
        messages=messages,
        temperature=0,
        max_tokens=48,
        seed=7,
        stream=True,
        stream_options={"include_usage": True},
    )
    parts, finish, usage, chunks = [], None, None, 0
    for chunk in stream:
        chunks += 1
        assert chunk.object == "chat.completion.chunk", chunk
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            if c.delta.content:
                parts.append(c.delta.content)
            if c.finish_reason:
                finish = c.finish_reason
    streamed = "".join(parts)
    print(f"stream: {chunks} chunks, {streamed!r} ({finish})")
    assert streamed == text, f"streamed {streamed!r} != whole {text!r}"
    assert finish == choice.finish_reason, (finish, choice.finish_reason)
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens, usage

    legacy = client.completions.create(
        model=model, prompt="Once upon a time", temperature=0, max_tokens=16
    )
    assert legacy.object == "text_completion", legacy
    assert legacy.choices[0].text, legacy
    print(f"completion: {legacy.choices[0].text!r}")

    try:
        client.chat.completions.create(model=model, messages="not a list of messages")
        raise AssertionError("a malformed request was accepted")
    except openai.BadRequestError as e:
        assert e.status_code == 400, e
        err = e.body
        assert isinstance(err, dict) and err.get("type") == "invalid_request_error", err
        assert err.get("message"), err
        print(f"malformed: 400 {err}")

    try:
        client.chat.completions.create(model="no-such-model", messages=messages)
        raise AssertionError("an unknown model was accepted")
    except openai.NotFoundError as e:
        assert e.status_code == 404, e
        err = e.body
        assert isinstance(err, dict) and err.get("code") == "model_not_found", err
        print(f"unknown model: 404 {err}")

    print("openai client: all checks passed")


if __name__ == "__main__":
    main()
