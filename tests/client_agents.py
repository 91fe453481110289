"""Agents written against the OpenAI client, as users write them, for the openai_agent tests (env.args.agent:
"tests.agents:<name>"). The tiny model's text is token ids as decimal numbers (the toy task)."""

from __future__ import annotations

import random
import threading
import time

from openai import AsyncOpenAI, OpenAI


def chat_loop(base_url, api_key, model, prompt, metadata, turns=3, reply="4 6 8 10", latency_s=0.0,
              latency_sigma=0.0):
    """A plain chat loop: the model answers, a 'tool' replies (after a lognormal wait around ``latency_s``),
    ``turns`` times; the task scores the last answer."""
    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = list(prompt)
    for t in range(turns):
        out = client.chat.completions.create(model=model, messages=messages, max_tokens=8)
        messages.append({"role": "assistant", "content": out.choices[0].message.content})
        if t + 1 < turns:
            time.sleep(min(2.0, latency_s * random.lognormvariate(0.0, latency_sigma)))
            messages.append({"role": "user", "content": reply})
    return None


async def async_chat_loop(base_url, api_key, model, prompt, metadata, turns=2):
    """The same loop with the async client; it returns its own reward."""
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = list(prompt)
    for _ in range(turns):
        out = await client.chat.completions.create(model=model, messages=messages, max_tokens=6)
        messages += [{"role": "assistant", "content": out.choices[0].message.content},
                     {"role": "user", "content": "2 4"}]
    return 0.5


def completion_loop(base_url, api_key, model, prompt, metadata):
    """Text completions, each prompt extending the last one and its answer."""
    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    text = prompt[-1]["content"]
    for _ in range(2):
        out = client.completions.create(model=model, prompt=text, max_tokens=5)
        text += out.choices[0].text + " 12 14 "
    return 1.0


def raises(base_url, api_key, model, prompt, metadata):
    OpenAI(base_url=base_url, api_key=api_key, max_retries=0).chat.completions.create(
        model=model, messages=prompt, max_tokens=4)
    raise RuntimeError("the agent's own bug")


def hangs(base_url, api_key, model, prompt, metadata):
    OpenAI(base_url=base_url, api_key=api_key, max_retries=0).chat.completions.create(
        model=model, messages=prompt, max_tokens=4)
    time.sleep(3600)


def too_many_calls(base_url, api_key, model, prompt, metadata):
    return chat_loop(base_url, api_key, model, prompt, metadata, turns=99)


def rewrites_history(base_url, api_key, model, prompt, metadata):
    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    first = client.chat.completions.create(model=model, messages=prompt, max_tokens=4)
    summary = [{"role": "user", "content": "7 7 7"}]  # drops the conversation for a summary of it
    client.chat.completions.create(model=model, messages=summary, max_tokens=4)
    return float(len(first.choices[0].message.content) > 0)


def calls_after_its_end(base_url, api_key, model, prompt, metadata):
    """Answers once and returns, leaving a thread that calls again after the episode ended."""
    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    client.chat.completions.create(model=model, messages=prompt, max_tokens=4)

    def late():
        time.sleep(0.5)
        try:
            client.chat.completions.create(model=model, messages=prompt, max_tokens=4)
        except Exception as e:  # noqa: BLE001
            print(f"late call refused: {type(e).__name__}", flush=True)
    threading.Thread(target=late, daemon=True).start()
    return 1.0


ADD = {"type": "function", "function": {"name": "add", "description": "add two numbers",
                                        "parameters": {"type": "object", "properties": {"a": {"type": "number"}}}}}


def uses_tools(base_url, api_key, model, prompt, metadata):
    """Declares a tool, then feeds a tool result back after each answer (the message as the client returned
    it, tool calls or not), the way a tool-calling loop does."""
    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = list(prompt)
    for _ in range(2):
        out = client.chat.completions.create(model=model, messages=messages, tools=[ADD], max_tokens=6)
        messages.append(out.choices[0].message)
        messages.append({"role": "tool", "tool_call_id": "call-0", "content": "3 5 7"})
    return 1.0


def langchain_loop(base_url, api_key, model, prompt, metadata, turns=2):
    """LangChain's ChatOpenAI, its own message types, fed back as a LangChain agent loop does."""
    from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=base_url, api_key=api_key, model=model, max_tokens=6, max_retries=0)
    kinds = {"system": SystemMessage, "user": HumanMessage}
    messages = [kinds[m["role"]](content=m["content"]) for m in prompt]
    for _ in range(turns):
        answer = llm.invoke(messages)
        assert isinstance(answer, AIMessage)
        messages += [answer, HumanMessage(content="8 8")]
    return 0.25


def returns_at_once(base_url, api_key, model, prompt, metadata):
    return 1.0  # never calls the model
