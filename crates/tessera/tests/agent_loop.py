"""An agent framework no one here wrote (pydantic-ai) driving a tool loop against the server:
the agent offers its tools (ours and its output tool), the model calls one, the framework runs
or validates it and records the return, until the structured answer arrives. Every turn is a
forced call (pydantic-ai asks for tool_choice "required" when the output is structured), so
the random-weight built-in model still produces calls that validate.

The model picks among the tools by its (random) logits: sampled with seed 3 it calls our tool
twice and then the output tool, which fits its 512-token context (greedy, it would call our
tool until the context is full). Sampling depends only on (seed, position), so this is
reproducible; a change to the engine's numerics may need another seed.

Usage: python3 agent_loop.py BASE_URL

Exits 0 when all pass; 3 when pydantic-ai is missing (the Rust test decides whether that fails).
"""

import sys
from typing import Literal

try:
    from pydantic import BaseModel, Field
    from pydantic_ai import Agent
    from pydantic_ai.messages import ToolCallPart, ToolReturnPart
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider
except ImportError as e:
    print(f"missing package: {e} (pip install 'pydantic-ai-slim[openai]')", file=sys.stderr)
    sys.exit(3)

BASE = sys.argv[1].rstrip("/")


class Forecast(BaseModel):
    city: Literal["Paris", "Rome", "Oslo"]
    days: int = Field(ge=1, le=7)


def main():
    import openai

    models = openai.OpenAI(base_url=BASE + "/v1", api_key="x").models.list().data
    model = OpenAIChatModel(
        models[0].id, provider=OpenAIProvider(base_url=BASE + "/v1", api_key="not-needed")
    )
    agent = Agent(
        model,
        output_type=Forecast,
        model_settings={
            "temperature": 1.0,
            "seed": 3,
            "max_tokens": 96,
            "parallel_tool_calls": False,
        },
        retries=3,
    )
    calls = []

    @agent.tool_plain
    def fetch_weather(city: Literal["Paris", "Rome", "Oslo"]) -> str:
        """Look up the weather in a city."""
        calls.append(city)
        return f"sunny in {city}"

    result = agent.run_sync("What is the weather in Paris for the next 3 days?")
    parts = [p for m in result.all_messages() for p in m.parts]
    made = [p.tool_name for p in parts if isinstance(p, ToolCallPart)]
    returned = [p.tool_name for p in parts if isinstance(p, ToolReturnPart)]
    print(f"tool calls: {made}; returns: {returned}; our tool ran with {calls}")
    print(f"output: {result.output!r}")
    assert isinstance(result.output, Forecast), result.output
    assert made and made == returned, (made, returned)
    assert calls, "the loop never ran our tool"
    assert made[-1] == "final_result", made
    print("agent loop: all checks passed")


if __name__ == "__main__":
    main()
