"""The OpenAI-compatible endpoint of one rollout rank (``env.name: openai_agent``): ``/v1/chat/completions``,
``/v1/completions`` and ``/v1/models``, non-streaming, served by Starlette under uvicorn in a thread of the
rank's process.

Invariants:
* this module checks the HTTP and the request's shape only; what a call means for its episode (which
  version, which tokens, whether it may be made) is decided on the rank's loop (runtime/agent_episodes.py),
  which answers every ``Call`` exactly once through ``Call.answer``;
* a call must carry a key the rank handed to a live episode (``Authorization: Bearer <key>``): none or an
  unknown one is 401, one whose episode ended is 403; neither reaches the loop, nor does a malformed request
  (400, with a message). Nothing outside the caller's episode is affected by any of them;
* refused, with 400 and a message naming the field: ``stream: true``, ``n`` > 1, a batch of prompts.
  Ignored: ``temperature``, ``top_p``, ``seed``, ``presence_penalty``, ``frequency_penalty`` (an episode is
  sampled with the run's ``sampling.*``: its logprobs are the behaviour policy's, which training needs).
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import queue
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

ROLES = ("system", "user", "assistant", "tool")


class BadRequest(ValueError):
    """A request the endpoint refuses with 400; the message names the field."""


@dataclass
class Call:
    """One HTTP call, handed to the rank's loop: ``kind`` "chat" or "completion", the episode's ``key``, the
    checked ``body``. ``answer(status, payload)`` may be called from any thread, once."""

    kind: str
    key: str
    body: dict[str, Any]
    answer: Callable[[int, dict[str, Any]], None] = field(repr=False)


def error(message: str, kind: str = "invalid_request_error", code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}


def episode_ended() -> dict[str, Any]:
    """The 403 of a call with an ended episode's key."""
    return error("this episode has ended; its key is no longer valid", "permission_error", "episode_ended")


def _text(content: Any, where: str) -> str:
    """A message's content as text: a string, None, or a list of text parts."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    raise BadRequest(f"{where}.content: a string or a list of text parts (images and audio are not served)")


def check_chat(body: dict[str, Any]) -> dict[str, Any]:
    """The chat request's fields this endpoint uses, checked; messages normalised to role, content (text),
    and tool_calls / tool_call_id / name where given."""
    _common(body)
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise BadRequest("messages: a non-empty list of messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise BadRequest(f"messages[{i}].role: one of {', '.join(ROLES)}")
        msg = {"role": m["role"], "content": _text(m.get("content"), f"messages[{i}]")}
        for k in ("tool_calls", "tool_call_id", "name"):
            if m.get(k) is not None:
                msg[k] = m[k]
        out.append(msg)
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise BadRequest("tools: a list of tool definitions")
    return {"messages": out, "tools": tools, **_limits(body)}


def check_completion(body: dict[str, Any]) -> dict[str, Any]:
    _common(body)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        pass  # token ids
    elif isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    elif not isinstance(prompt, str) or not prompt:
        raise BadRequest("prompt: a non-empty string or a list of token ids (a batch of prompts is not served)")
    return {"prompt": prompt, **_limits(body)}


def _common(body: dict[str, Any]) -> None:
    if body.get("stream"):
        raise BadRequest("stream: not served; call without streaming")
    if body.get("n") not in (None, 1):
        raise BadRequest("n: only 1 (an episode is one conversation; GRPO's samples are separate episodes)")
    if body.get("echo"):
        raise BadRequest("echo: not served")


def _limits(body: dict[str, Any]) -> dict[str, Any]:
    n = body.get("max_completion_tokens", body.get("max_tokens"))
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
        raise BadRequest("max_tokens: a positive integer")
    return {"max_tokens": n, "logprobs": bool(body.get("logprobs"))}


class Gateway:
    """The endpoint: ``start()`` binds ``host`` (port 0: any free one) and serves until ``close()``. The rank's
    loop owns ``keys`` (key -> episode id) and ``ended`` (keys of ended episodes) and takes ``calls``."""

    def __init__(self, host: str = "127.0.0.1", model: str = "policy") -> None:
        self.host, self.model = host, model
        self.keys: dict[str, int] = {}
        self.ended: set[str] = set()
        self.calls: queue.SimpleQueue[Call] = queue.SimpleQueue()
        self._server = None
        self._thread: threading.Thread | None = None
        self.port = 0

    @property
    def base_url(self) -> str:
        """What this host's agents call: the loopback address of the bound family when bound to every
        interface (0.0.0.0, ::), an IPv6 literal in brackets."""
        addr = ipaddress.ip_address(self.host)
        if addr.is_unspecified:
            addr = ipaddress.ip_address("::1" if addr.version == 6 else "127.0.0.1")
        host = f"[{addr}]" if addr.version == 6 else str(addr)
        return f"http://{host}:{self.port}/v1"

    def start(self) -> None:
        import uvicorn
        from starlette.applications import Starlette
        from starlette.routing import Route

        # proto IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on sockets that say they are TCP; without it a
        # response's headers and body are two writes, and the body waits out the client's delayed ACK (~40 ms)
        sock = socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET, socket.SOCK_STREAM,
                             socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, 0))
        self.port = sock.getsockname()[1]
        app = Starlette(routes=[Route("/v1/chat/completions", self._chat, methods=["POST"]),
                                Route("/v1/completions", self._completion, methods=["POST"]),
                                Route("/v1/models", self._models, methods=["GET"])])
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off", timeout_keep_alive=30)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=lambda: asyncio.run(self._server.serve(sockets=[sock])),
                                        name="gateway", daemon=True)
        self._thread.start()

    def close(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            if self._thread is not None:
                self._thread.join(timeout=5)
            self._server = None

    async def _models(self, request):
        from starlette.responses import JSONResponse

        return JSONResponse({"object": "list", "data": [{"id": self.model, "object": "model", "owned_by": "dora-hpc"}]})

    async def _chat(self, request):
        return await self._serve(request, "chat", check_chat)

    async def _completion(self, request):
        return await self._serve(request, "completion", check_completion)

    async def _serve(self, request, kind: str, check: Callable[[dict], dict]):
        from starlette.responses import JSONResponse

        auth = request.headers.get("authorization", "")
        key = auth.removeprefix("Bearer ").strip() if auth.startswith("Bearer ") else ""
        if key in self.ended:
            return JSONResponse(episode_ended(), status_code=403)
        if key not in self.keys:
            return JSONResponse(error("unknown API key: each episode has its own", "authentication_error",
                                      "invalid_api_key"), status_code=401)
        try:
            body = json.loads(await request.body())
            if not isinstance(body, dict):
                raise BadRequest("the body must be a JSON object")
            checked = check(body)
        except json.JSONDecodeError as e:
            return JSONResponse(error(f"the body is not JSON ({e})"), status_code=400)
        except BadRequest as e:
            return JSONResponse(error(str(e)), status_code=400)
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()

        def answer(status: int, payload: dict[str, Any]) -> None:
            loop.call_soon_threadsafe(lambda: done.done() or done.set_result((status, payload)))

        self.calls.put(Call(kind, key, checked, answer))
        status, payload = await done
        return JSONResponse(payload, status_code=status)
