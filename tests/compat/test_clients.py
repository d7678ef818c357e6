"""Real third-party clients, unchanged, against the served tiny model: what
each sends is accepted and what comes back parses into the client's own types."""
from __future__ import annotations

import asyncio
from typing import Annotated

import pytest
from pydantic import BaseModel, Field

MODEL = "tiny"  # the served_model_name of tests/compat/conftest.py


class City(BaseModel):
    """Schemas bound every string and number, so a random-weight model always
    finishes the object well inside max_tokens."""
    name: str = Field(max_length=8)
    population: int = Field(ge=0, le=1000)


def _lookup_city(name: str) -> str:
    """Look a city up by name."""
    return f"{name}: 42"


# ---- langchain-openai ------------------------------------------------------------------

def _chat_openai(base_url: str, **kw):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(base_url=base_url, api_key="none", model=MODEL, temperature=0,
                      max_retries=0, **{"max_tokens": 200, **kw})


def test_langchain_invoke_and_stream(base_url):
    llm = _chat_openai(base_url, max_tokens=8)
    msg = llm.invoke("Hello there")
    assert isinstance(msg.content, str) and msg.response_metadata["finish_reason"] in ("stop", "length")
    chunks = list(llm.stream("Hello there"))
    assert "".join(c.content for c in chunks) == msg.content  # greedy: same text both ways


# json_mode is left out: with no schema sent, closing the object is the model's skill.
@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
@pytest.mark.parametrize("strict", [True, None])
def test_langchain_with_structured_output(base_url, method, strict):
    """pydantic's schemas omit additionalProperties: strict or not, the answer
    must close (no undeclared keys) and parse."""
    out = _chat_openai(base_url).with_structured_output(
        City, method=method, include_raw=True, strict=strict).invoke("A city as JSON")
    assert out["parsing_error"] is None and isinstance(out["parsed"], City)


class CityQuery(BaseModel):
    name: str = Field(max_length=8, description="the city")


def test_langchain_bind_tools_required(base_url):
    from langchain_core.tools import StructuredTool

    lookup = StructuredTool.from_function(_lookup_city, args_schema=CityQuery)
    msg = _chat_openai(base_url).bind_tools([lookup], tool_choice="required").invoke("Paris?")
    assert msg.tool_calls and msg.tool_calls[0]["name"] == "_lookup_city"
    assert isinstance(msg.tool_calls[0]["args"].get("name"), str)


# ---- instructor ------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["TOOLS", "JSON_SCHEMA"])
def test_instructor_modes(base_url, mode):
    import instructor
    from openai import OpenAI

    client = instructor.from_openai(OpenAI(base_url=base_url, api_key="none", max_retries=0),
                                    mode=getattr(instructor.Mode, mode))
    city = client.chat.completions.create(model=MODEL, response_model=City, max_retries=0,
                                          max_tokens=200, temperature=0,
                                          messages=[{"role": "user", "content": "Name a city"}])
    assert isinstance(city, City)


# ---- pydantic-ai -----------------------------------------------------------------------

def _pydantic_ai_model(base_url: str):
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    return OpenAIChatModel(MODEL, provider=OpenAIProvider(base_url=base_url, api_key="none"))


def test_pydantic_ai_text_and_native_output(base_url):
    from pydantic_ai import Agent, NativeOutput

    settings = {"max_tokens": 16, "temperature": 0.0}
    text = Agent(_pydantic_ai_model(base_url), model_settings=settings).run_sync("Hello")
    assert isinstance(text.output, str)
    agent = Agent(_pydantic_ai_model(base_url), output_type=NativeOutput(City),
                  model_settings={**settings, "max_tokens": 200})
    assert isinstance(agent.run_sync("Name a city").output, City)


# ---- litellm ---------------------------------------------------------------------------

def test_litellm_completion_and_stream(base_url):
    import litellm

    kw = dict(model=f"openai/{MODEL}", api_base=base_url, api_key="none", max_tokens=8,
              temperature=0, messages=[{"role": "user", "content": "Hello"}])
    r = litellm.completion(**kw)
    text = r.choices[0].message.content
    assert isinstance(text, str) and r.usage.completion_tokens >= 1
    streamed = "".join(c.choices[0].delta.content or "" for c in litellm.completion(stream=True, **kw))
    assert streamed == text


# ---- openai-agents ---------------------------------------------------------------------

def _agents_run(base_url: str, agent_kw: dict, use_responses: bool):
    """Runs one agent on the served model; agent_kw may override model_settings."""
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        Runner,
        set_tracing_disabled,
    )
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    client = AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0)
    cls = OpenAIResponsesModel if use_responses else OpenAIChatCompletionsModel
    agent = Agent(name="compat", instructions="Answer briefly.",
                  model=cls(model=MODEL, openai_client=client),
                  **{"model_settings": ModelSettings(temperature=0.0, max_tokens=200), **agent_kw})
    return asyncio.run(Runner.run(agent, "Name a city", max_turns=4))


@pytest.mark.parametrize("use_responses", [False, True], ids=["chat", "responses"])
def test_openai_agents_output_type(base_url, use_responses):
    result = _agents_run(base_url, {"output_type": City}, use_responses)
    assert isinstance(result.final_output, City)


@pytest.mark.parametrize("use_responses", [False, True], ids=["chat", "responses"])
def test_openai_agents_tool_then_output_type(base_url, use_responses):
    """Turn one must call the tool (tool_choice required). Turn two carries the
    tool's output back, with the tools under auto and the output type's schema
    at once: whatever the model picks there (a second call or the answer), the
    SDK must parse it. Which one it picks is the model's skill, so a second
    call ends the run with the tool's own result."""
    from agents import ModelSettings, ToolsToFinalOutputResult, function_tool

    calls = []

    @function_tool
    def lookup_city(name: Annotated[str, Field(max_length=8)]) -> str:
        """Look a city up by name."""
        calls.append(name)
        return name

    def stop_on_second_call(_ctx, results) -> ToolsToFinalOutputResult:
        if len(calls) < 2:
            return ToolsToFinalOutputResult(is_final_output=False)
        return ToolsToFinalOutputResult(is_final_output=True,
                                        final_output=City(name=results[-1].output, population=1))

    kw = {"tools": [lookup_city], "output_type": City, "tool_use_behavior": stop_on_second_call,
          "model_settings": ModelSettings(temperature=0.0, max_tokens=200, tool_choice="required")}
    result = _agents_run(base_url, kw, use_responses)
    assert calls, "the forced first turn called the tool"
    assert isinstance(result.final_output, City)
    assert len(result.raw_responses) >= 2  # the turn after the tool's output was answered and parsed
