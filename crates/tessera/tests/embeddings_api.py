"""Embeddings through the official `openai` and `ollama` Python clients.

Usage: python3 embeddings_api.py BASE_URL serve|cluster

serve: `client.embeddings.create` answers one unit vector per input, the same whether the
client asks for floats or (its default) base64, the same alone as in a list, with
`usage.prompt_tokens`; `ollama.embed` answers the same vectors, `ollama.embeddings` the same
direction unnormalized; `dimensions` is refused with a 400 naming it; `ollama.show` lists the
"embedding" capability.
cluster: both endpoints answer 501 saying a distributed cluster does not serve embeddings yet.

Exits 0 when all pass; 3 when a package is missing (the Rust test decides whether that fails).
"""

import math
import struct
import sys

try:
    import ollama
    import openai
except ImportError as e:
    print(f"missing package: {e} (pip install openai ollama)", file=sys.stderr)
    sys.exit(3)

BASE, MODE = sys.argv[1].rstrip("/"), sys.argv[2]
oa = openai.OpenAI(base_url=BASE + "/v1", api_key="not-needed", max_retries=0, timeout=120)
ol = ollama.Client(host=BASE, timeout=120)
TEXTS = ["Once upon a time", "The cat sat on the mat.", "A big red ball."]


def norm(v):
    return math.sqrt(sum(x * x for x in v))


def f32(v):
    """The float32 values of `v`: JSON's shortest decimals read as doubles are not exactly the
    float32s they name, base64's are."""
    return list(struct.unpack(f"<{len(v)}f", struct.pack(f"<{len(v)}f", *v)))


def check_served(model):
    floats = oa.embeddings.create(model=model, input=TEXTS, encoding_format="float")
    assert floats.object == "list" and len(floats.data) == len(TEXTS), floats
    assert [d.index for d in floats.data] == list(range(len(TEXTS))), floats.data
    vectors = [d.embedding for d in floats.data]
    width = len(vectors[0])
    assert width > 0 and all(len(v) == width for v in vectors), [len(v) for v in vectors]
    for v in vectors:
        assert abs(norm(v) - 1.0) < 1e-5, norm(v)
    assert vectors[0] != vectors[1], "different texts, same vector"
    assert floats.usage.prompt_tokens > len(TEXTS), floats.usage
    assert floats.usage.total_tokens == floats.usage.prompt_tokens, floats.usage
    # The client's default is base64, which it decodes itself.
    default = oa.embeddings.create(model=model, input=TEXTS)
    assert [f32(d.embedding) for d in default.data] == [f32(v) for v in vectors], "base64"
    alone = oa.embeddings.create(model=model, input=TEXTS[1], encoding_format="float")
    assert alone.data[0].embedding == vectors[1], "alone differs from in a list"
    print(f"openai: {len(vectors)} vectors of {width}, {floats.usage.prompt_tokens} tokens")

    try:
        oa.embeddings.create(model=model, input="a", dimensions=8)
        raise AssertionError("dimensions was accepted")
    except openai.BadRequestError as e:
        assert e.status_code == 400 and e.body.get("param") == "dimensions", e.body

    name = model + ":latest"
    r = ol.embed(model=name, input=TEXTS)
    assert r.embeddings == vectors, "ollama's /api/embed differs from /v1/embeddings"
    assert r.prompt_eval_count == floats.usage.prompt_tokens, r
    one = ol.embed(model=name, input=TEXTS[0])
    assert one.embeddings == [vectors[0]], one
    legacy = ol.embeddings(model=name, prompt=TEXTS[0]).embedding
    scale = norm(legacy)
    assert all(abs(a / scale - b) < 1e-5 for a, b in zip(legacy, vectors[0])), "direction"
    assert "embedding" in ol.show(name).capabilities
    print(f"ollama: embed equals openai's; embeddings has norm {scale:.4f}")


def check_refused(model):
    try:
        oa.embeddings.create(model=model, input=TEXTS)
        raise AssertionError("a cluster answered embeddings")
    except openai.APIStatusError as e:
        assert e.status_code == 501, e
        assert "distributed cluster" in str(e.body), e.body
    try:
        ol.embed(model=model, input=TEXTS)
        raise AssertionError("a cluster answered ollama embed")
    except ollama.ResponseError as e:
        assert e.status_code == 501 and "distributed cluster" in e.error, e
    assert "embedding" not in ol.show(model).capabilities
    print("cluster: 501 for embeddings on both APIs")


def main():
    model = oa.models.list().data[0].id
    if MODE == "serve":
        check_served(model)
    else:
        check_refused(model)
    print(f"embeddings api ({MODE}): all checks passed")


if __name__ == "__main__":
    main()
