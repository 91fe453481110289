"""Tool calls in the Hermes format (Qwen2.5's, and what SmolLM2 learnt): the OpenAI API's ``tools``,
``tool_calls`` and ``role: tool`` messages to and from text the model reads and writes.

* a model calls a tool by writing ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (one block per
  call); ``parse`` turns an answer into (content, tool_calls), and leaves a block that is not such JSON in the
  content, untouched;
* ``to_template`` rewrites messages for a chat template that does not render tools itself (SmolLM2's): the
  tools join the system prompt as Qwen2.5's template writes them, an assistant message's tool calls become
  its blocks, and consecutive tool results become one user turn of ``<tool_response>`` blocks. A template
  that renders tools (its source mentions them) gets the messages as they are.
"""

from __future__ import annotations

import json
import re
from typing import Any

BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
DEFAULT_SYSTEM = "You are a helpful assistant."


def parse(text: str, call_id: str) -> tuple[str | None, list[dict[str, Any]]]:
    """An answer's content (None when it is only tool calls) and its ``tool_calls``, OpenAI-shaped; ids are
    ``{call_id}-{i}``."""
    calls: list[dict[str, Any]] = []
    kept: list[str] = []
    last = 0
    for m in BLOCK.finditer(text):
        try:
            obj = json.loads(m.group(1))
            name, args = obj["name"], obj.get("arguments", {})
            if not isinstance(name, str):
                raise TypeError(name)
        except (ValueError, KeyError, TypeError):
            continue  # not a call: stays in the content
        kept.append(text[last:m.start()])
        last = m.end()
        calls.append({"id": f"{call_id}-{len(calls)}", "type": "function",
                      "function": {"name": name, "arguments": args if isinstance(args, str) else json.dumps(args)}})
    kept.append(text[last:])
    content = "".join(kept).strip() if calls else text
    return (content or None) if calls else content, calls


def native(template: str | None) -> bool:
    """Whether a chat template renders ``tools`` and tool messages itself."""
    return bool(template) and "tool" in template


def to_template(messages: list[dict[str, Any]], tools: list | None, first: bool) -> list[dict[str, str]]:
    """``messages`` as plain role/content messages for a template without tools; ``first``: they open the
    conversation (the tools go into its system prompt)."""
    out: list[dict[str, str]] = []
    for m in messages:
        if m["role"] == "tool":
            block = f"<tool_response>\n{m['content']}\n</tool_response>"
            if out and out[-1]["role"] == "user" and out[-1]["content"].startswith("<tool_response>"):
                out[-1] = {"role": "user", "content": out[-1]["content"] + "\n" + block}
            else:
                out.append({"role": "user", "content": block})
        elif m["role"] == "assistant" and m.get("tool_calls"):
            blocks = [json.dumps({"name": c["function"]["name"], "arguments": _args(c["function"]["arguments"])})
                      for c in m["tool_calls"]]
            text = "\n".join([m["content"]] * bool(m["content"]) + [f"<tool_call>\n{b}\n</tool_call>" for b in blocks])
            out.append({"role": "assistant", "content": text})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    if first and tools:
        header = _tools_prompt(tools)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + header}
        else:
            out.insert(0, {"role": "system", "content": DEFAULT_SYSTEM + "\n\n" + header})
    return out


def _args(arguments: Any) -> Any:
    try:
        return json.loads(arguments) if isinstance(arguments, str) else arguments
    except ValueError:
        return arguments


def _tools_prompt(tools: list) -> str:
    sigs = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n"
            f"<tools>\n{sigs}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments within "
            "<tool_call></tool_call> XML tags:\n<tool_call>\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')
