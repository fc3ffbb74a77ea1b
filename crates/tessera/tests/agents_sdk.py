"""The OpenAI Agents SDK (`openai-agents`) against a running server: its default model (the
Responses API, with what the SDK always sends, `include: []` among it) runs an agent with a
tool to completion.

Usage: python3 agents_sdk.py BASE_URL serve|cluster

The tool is forced (`tool_choice="required"`, as a random-weight model would never choose it),
and the run stops on the tool's result (`tool_use_behavior="stop_on_first_tool"`): the final
output is what the tool returned for the arguments the model wrote. The mode only labels the
output.

Exits 0 when all pass; 3 when a package is missing (the Rust test decides whether that fails).
"""

import json
import sys
import urllib.request
from typing import Literal

try:
    from agents import (Agent, ModelSettings, Runner, function_tool, set_default_openai_client,
                        set_tracing_disabled)
    from openai import AsyncOpenAI
except ImportError as e:
    print(f"missing package: {e} (pip install openai-agents)", file=sys.stderr)
    sys.exit(3)

BASE, MODE = sys.argv[1].rstrip("/"), sys.argv[2]
client = AsyncOpenAI(base_url=BASE + "/v1", api_key="not-needed", max_retries=0, timeout=120)
set_default_openai_client(client, use_for_tracing=False)
set_tracing_disabled(True)

calls = []


@function_tool
def get_weather(city: Literal["Paris", "Rome"]) -> str:
    """The weather forecast for a city."""
    calls.append(city)
    return f"sunny in {city}"


def model_id():
    # Not through the async client: its connections belong to the event loop that made them.
    with urllib.request.urlopen(BASE + "/v1/models", timeout=60) as r:
        return json.loads(r.read())["data"][0]["id"]


def main():
    model = model_id()
    agent = Agent(
        name="weather",
        instructions="You answer questions about the weather.",
        model=model,
        tools=[get_weather],
        model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=300),
        tool_use_behavior="stop_on_first_tool",
    )
    result = Runner.run_sync(agent, "What is the weather in Paris?")
    assert calls and calls[0] in ("Paris", "Rome"), calls
    assert result.final_output == f"sunny in {calls[0]}", result.final_output
    print(f"agents sdk ({MODE}): tool called with {calls[0]!r}")


if __name__ == "__main__":
    main()
