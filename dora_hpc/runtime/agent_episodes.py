"""Agent episodes on one rollout rank (``env.name: openai_agent``, envs/openai_agent.py): the user's agent drives
the episode through an OpenAI-compatible endpoint (gateway.py) instead of an environment's steps.

An episode has two places. Its *home* is the rank it was dispatched to: the agent runs there (one job in the
rank's environment workers, envs/pool.py) and calls that rank's endpoint with the episode's own key. Its
*holder* is the rank whose engine holds its request: the home, or wherever the orchestrator migrated it. The
home turns each call into the tokens that extend the episode and sends them to the holder (AgentCall); the
holder generates and sends the answer back (AgentTurn); the home answers the call.

Invariants:
* every call of an episode is sampled under the version its group was tagged with, as one held engine request
  from the first call's prompt to the last answer (the KV kept between calls, migrated with the request), so
  the trajectory is the recorded ids: the first call's prompt, then each answer (trained) and each later
  call's new tokens (``env_spans``, masked). Nothing is re-tokenized;
* a chat call must extend the previous one: the same messages, then the answer as the assistant message,
  then new messages, which alone are tokenized (``task.render_env``, as an environment's reply is); a
  completion's prompt must extend the previous prompt plus answer (as text, or as token ids). A call that
  rewrites history gets 400 and changes nothing;
* one call at a time per episode (409 otherwise); past ``env.max_turns`` calls the call gets 400 and the
  episode ends with that error;
* the home keeps the call in flight until its answer comes. A holder that receives the episode sends AgentHere
  (its migration count orders them) and the home sends the call again: the previous holder dropped it;
* an episode ends exactly once, at its holder, on AgentEnd: the agent's reward, or the task's score of the
  last answer when the agent returned None; reward 0 and the error when the agent raised, timed out (more
  than ``env.timeout_s`` of its own time between answers), or made too many calls. Its key is then refused
  (403). An agent that ended before any answer gets one turn from the task's prompt as its sample (reward 0,
  the cause recorded), so that every trajectory has model tokens to train on;
* a lost rank costs its episodes only: one held here whose home was fenced ends with that cause (its agent
  died with it); one homed here whose holder was fenced is forgotten (rank 0 starts it again elsewhere);
* the episode's ``env_s`` is the agent's own time (dispatch to its first call, each answer to the next call,
  the last answer to its return), the share of the episode its environment took.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field, replace
from typing import Any

from ..data.tool_calls import parse
from ..envs import Scorer, make_env
from .env_workers import tell_waiting, worker_pool
from .gateway import BadRequest, Call, Gateway, episode_ended, error
from .messages import AgentCall, AgentEnd, AgentEnded, AgentHere, AgentTurn


@dataclass
class Home:
    """What the home rank keeps of an episode it dispatched (never migrates)."""

    key: str
    job: int
    group_id: int
    holder: int
    hops: int = 0
    turn: int = 0                     # calls answered
    kind: str = ""                    # "chat" or "completion", fixed by the first call
    messages: list[dict] = field(default_factory=list)  # the conversation so far, the last answer included
    tools: Any = None
    text: str = ""                    # a text completion's prompt plus answer so far
    ids: list[int] = field(default_factory=list)  # the episode's token ids so far (prompt plus answers)
    reply: str = ""                   # the last answer's text (what the task scores when the agent returns None)
    call: AgentCall | None = None     # the call in flight, until its answer
    http: Call | None = None
    staged: dict = field(default_factory=dict)  # what the call in flight adds to the conversation
    since: float = 0.0                # when the agent last got an answer (or started)
    capped: bool = False              # env.max_episode_tokens reached: nothing more can be generated
    ended: tuple[float, str] | None = None


class AgentEpisodes:
    """Driven like runtime/episodes.py's Episodes by a rollout rank or ``dora-hpc eval`` (``rank`` has ``cfg``,
    ``task``, ``engine``, ``info`` and ``finish``; a rollout rank also ``comm`` and ``instance``)."""

    def __init__(self, rank, model_dir) -> None:
        self.rank, self.env_cfg = rank, rank.cfg.env
        self.pool = worker_pool(rank, model_dir, network=True)  # the agent reaches the endpoint over the network
        self.gateway = Gateway(self.env_cfg.listen, model=rank.cfg.model.path)
        self.gateway.start()
        self.me = rank.comm.rank if hasattr(rank, "comm") else 0
        self.homes: dict[int, Home] = {}
        self.jobs: dict[int, int] = {}  # pool job -> traj id
        self.told = (0, 0.0)
        self.fenced_seen: set[int] = set()

    # -- the holder's side: the rank's engine and the request's info ------------------------------------------
    def begin(self, traj_id: int, prompt: list[int], params, version: int, info: dict, group_id: int) -> None:
        """A dispatched episode: its agent starts here (the home); nothing is on the engine until its first call."""
        info.update(episode=True, agent=True, home=self.me, unstarted=True, version=version, params=params,
                    task_prompt=list(prompt), env=None, env_error="", turns=0, turn_start=0, env_spans=[],
                    env_rewards=[], env_s=0.0, env_prefill=0, env_reruns=0, pending=0, last=None)
        key = secrets.token_urlsafe(18)
        try:
            run = make_env("openai_agent", Scorer(group_id), self.env_cfg.max_turns, self.env_cfg.timeout_s,
                           self.env_cfg.args)
            run.init(self.rank.task.messages(group_id))
            run.bind(self.gateway.base_url, key, self.gateway.model,
                     {"group_id": group_id, "answer": self.rank.task.ground_truth(group_id), "score": Scorer(group_id)})
        except Exception as e:  # noqa: BLE001 - the user's agent module may raise anything on import
            info["env_error"] = f"agent: {type(e).__name__}: {e}"
            self.end(traj_id, info)
            return
        if traj_id in self.homes:  # dispatched again (its holder was lost) before this rank heard of the loss
            self._forget(traj_id)
        job = self.pool.submit(run, "")
        self.jobs[job] = traj_id
        self.homes[traj_id] = Home(key, job, group_id, holder=self.me, since=time.monotonic())
        self.gateway.keys[key] = traj_id

    def turn_ended(self, f, info: dict) -> None:
        """The engine answered a call: the answer goes home; the request waits (KV held) for the next call."""
        info["last"], info["turns"] = f, info["turns"] + 1
        if info.get("closing"):  # the stand-in turn of an episode whose agent never got an answer
            return self.end(f.req_id, info)
        start = info["turn_start"]
        info["pending"] = info["turns"]
        self.send(AgentTurn(f.req_id, info["turns"] - 1, f.response[start:], f.logprobs[start:], f.finish_reason,
                            len(f.prompt) + start), info["home"])

    def on_call(self, msg: AgentCall) -> None:
        info = self.rank.info.get(msg.traj_id)
        if info is None or info.get("pending") != msg.turn:
            return  # it moved on (its next holder announces itself) or this is a copy already taken
        info["pending"], info["env_s"] = None, info["env_s"] + msg.agent_s
        cap, engine = self.env_cfg.max_episode_tokens, self.rank.engine
        if info["unstarted"]:
            budget = min(msg.max_tokens, cap - len(msg.tokens))
            if budget < 1:
                return self._capped(msg, info, len(msg.tokens))
            engine.add(msg.traj_id, msg.tokens, replace(info["params"], max_tokens=budget), info["version"],
                       hold=True)
            info["unstarted"] = False
            return
        last = info["last"]
        used = len(last.prompt) + len(last.response)
        budget = min(msg.max_tokens, cap - used - len(msg.tokens))
        if budget < 1:
            return self._capped(msg, info, used)
        start = len(last.response)
        engine.extend(msg.traj_id, msg.tokens, budget)
        if msg.tokens:
            info["env_spans"].append((start, start + len(msg.tokens)))
            info["env_prefill"] += len(msg.tokens)
        info["turn_start"] = start + len(msg.tokens)

    def _capped(self, msg: AgentCall, info: dict, used: int) -> None:
        """The call would pass env.max_episode_tokens: it is answered with nothing; the episode waits for its
        end (the agent's reward still counts)."""
        info["pending"] = -1  # no further call is taken
        self.send(AgentTurn(msg.traj_id, msg.turn, [], [], "episode_cap", used), info["home"])

    def on_end(self, msg: AgentEnd) -> None:
        info = self.rank.info.get(msg.traj_id)
        if info is None:
            return  # it moved on: its next holder announces itself and the home sends this again
        info["env_s"] += msg.agent_s
        info["env_rewards"] = [msg.reward]
        info["env_error"] = msg.error
        self.end(msg.traj_id, info)

    def end(self, tid: int, info: dict) -> None:
        engine = self.rank.engine
        if info["last"] is None:  # no answer yet: a turn from the task's prompt stands in for the episode (a real
            info["env_error"] = info["env_error"] or "agent: returned without calling the model"  # sample of
            if not info.get("closing"):  # its version; reward 0 with the cause), so its group stays trainable
                info["closing"], info["unstarted"], info["pending"] = True, False, None
                if engine.has_request(tid):
                    engine.abort(tid)
                engine.add(tid, info["task_prompt"], info["params"], info["version"])
            return
        if engine.has_request(tid):
            engine.abort(tid)  # frees the KV it kept between calls
        kv_frac = engine.stats()["kv_used_fraction"]
        f = info["last"]
        self.rank.finish(replace(f, finish_reason="env_error" if info["env_error"] else f.finish_reason), kv_frac)
        if info["home"] not in self.fenced_seen:
            self.send(AgentEnded(tid), info["home"])

    def left(self, info: dict) -> None:
        """The episode left this rank (migrated): nothing runs here for it (its agent stays at home)."""

    def arrived(self, traj_id: int, info: dict) -> None:
        """A migrated episode landed here: the home learns where it is, and sends the call it waits on again."""
        self.send(AgentHere(traj_id, info["pending"], info["n_migrations"]), info["home"])

    # -- the home's side: the agent, its calls, its end ----------------------------------------------------------
    def on_http(self, call: Call) -> None:
        tid = self.gateway.keys.get(call.key)
        h = self.homes.get(tid) if tid is not None else None
        if h is None or h.ended or h.key != call.key:  # (a trajectory dispatched again has a new key)
            return call.answer(403, episode_ended())
        if h.http is not None:
            return call.answer(409, error("a call of this episode is in flight: one call at a time per episode"))
        if h.capped:
            return call.answer(400, error(f"the episode reached env.max_episode_tokens "
                                          f"({self.env_cfg.max_episode_tokens}); nothing more is generated"))
        if h.turn >= self.env_cfg.max_turns:
            call.answer(400, error(f"more than env.max_turns ({self.env_cfg.max_turns}) calls in one episode"))
            return self._end_home(tid, 0.0, f"agent: more than env.max_turns ({self.env_cfg.max_turns}) calls")
        try:
            tokens = self._tokens(h, call)
        except BadRequest as e:
            return call.answer(400, error(str(e)))
        limit = self.rank.task.max_tokens(tid, h.turn)
        asked = call.body["max_tokens"]
        now = time.monotonic()
        h.call, h.http = AgentCall(tid, h.turn, tokens, min(limit, asked or limit), now - h.since), call
        self.pool.pause(h.job)
        self.send(h.call, h.holder)

    def _tokens(self, h: Home, call: Call) -> list[int]:
        """The tokens call ``h.turn`` adds to the episode (all of the first call's prompt); BadRequest when the
        call does not extend the episode. What the call adds to the conversation is staged until its answer."""
        task, body = self.rank.task, call.body
        if h.turn and call.kind != h.kind:
            raise BadRequest(f"this episode's calls are {h.kind} calls; one episode is one conversation")
        if call.kind == "chat":
            msgs = body["messages"]
            if h.turn == 0:
                h.staged = {"messages": msgs, "tools": body["tools"]}
                return task.chat_ids(msgs, body["tools"])
            if body["tools"] != h.tools:
                raise BadRequest("tools: they changed within the episode (they are part of its first prompt)")
            n = len(h.messages)
            for i, (got, had) in enumerate(zip(msgs, h.messages, strict=False)):
                if got != had:
                    raise BadRequest(f"messages[{i}]: it differs from the episode's conversation: a call must "
                                     f"extend the previous call's messages and its answer (history is not rewritten"
                                     f" within an episode)")
            if len(msgs) < n:
                raise BadRequest(f"messages: {len(msgs)} messages, but the episode's conversation already has {n} "
                                 f"(the previous call's and its answer)")
            new = msgs[n:]
            h.staged = {"messages": msgs}
            return task.render_env(new, h.ids[-1]) if new else []
        prompt = body["prompt"]
        if isinstance(prompt, list):
            if h.turn and prompt[:len(h.ids)] != h.ids:
                raise BadRequest("prompt: its token ids do not extend the previous prompt plus its answer")
            h.staged = {"ids": prompt}
            return prompt[len(h.ids):] if h.turn else prompt
        if h.turn and not prompt.startswith(h.text):
            raise BadRequest("prompt: it does not extend the previous prompt plus its answer")
        h.staged = {"text": prompt}
        return task.encode(prompt[len(h.text):], first=False) if h.turn else task.encode(prompt, first=True)

    def on_turn(self, msg: AgentTurn) -> None:
        h = self.homes.get(msg.traj_id)
        if h is None or h.call is None or h.call.turn != msg.turn:
            return  # a copy (the call was sent again after a migration and answered twice) or a stale one
        task = self.rank.task
        text = task.decode_turn(msg.tokens)
        if h.turn == 0:
            h.kind, h.tools = h.http.kind, h.staged.get("tools")
        h.ids = (h.ids if h.turn else []) + h.call.tokens + msg.tokens
        finish = "length" if msg.finish_reason in ("length", "episode_cap") else "stop"
        message = answer_message(text, f"call-{msg.traj_id}-{msg.turn}", bool(h.tools))
        if h.kind == "chat":  # as the agent will send it back (gateway.check_chat's normal form)
            h.messages = [*h.staged["messages"], {**message, "content": message["content"] or ""}]
            finish = "tool_calls" if "tool_calls" in message and finish == "stop" else finish
        elif "text" in h.staged:
            h.text = h.staged["text"] + text
        h.reply, h.turn, h.capped = text, h.turn + 1, msg.finish_reason == "episode_cap"
        http, h.call, h.http = h.http, None, None
        h.since = time.monotonic()
        self.pool.resume(h.job)
        http.answer(200, self._response(http, msg, text, message, finish))

    def _response(self, call: Call, msg: AgentTurn, text: str, message: dict, finish: str) -> dict[str, Any]:
        usage = {"prompt_tokens": msg.prompt_tokens, "completion_tokens": len(msg.tokens),
                 "total_tokens": msg.prompt_tokens + len(msg.tokens)}
        common = {"id": f"dora-{msg.traj_id}-{msg.turn}", "created": int(time.time()), "model": self.gateway.model,
                  "usage": usage}
        if call.kind == "completion":
            return {**common, "object": "text_completion",
                    "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}]}
        logprobs = None
        if call.body["logprobs"]:
            logprobs = {"content": [{"token": self.rank.task.decode_turn([t]), "logprob": lp, "bytes": None,
                                     "top_logprobs": []} for t, lp in zip(msg.tokens, msg.logprobs, strict=True)]}
        return {**common, "object": "chat.completion",
                "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": logprobs}]}

    def on_here(self, msg: AgentHere, src: int) -> None:
        h = self.homes.get(msg.traj_id)
        if h is None or msg.hops <= h.hops:
            return
        h.holder, h.hops = src, msg.hops
        if h.ended:
            self.send(AgentEnd(msg.traj_id, *h.ended), src)
        elif h.call is not None and msg.turn == h.call.turn:
            self.send(h.call, src)

    def _end_home(self, tid: int, reward: float, err: str) -> None:
        h = self.homes[tid]
        if h.ended:
            return
        h.ended = (reward, err)
        agent_s = time.monotonic() - h.since if h.call is None else 0.0
        self._retire(h)
        if h.holder not in self.fenced_seen:
            self.send(AgentEnd(tid, reward, err, agent_s), h.holder)

    def lost(self) -> None:
        """Ranks rank 0 fenced (``comm.fenced``): an episode held here whose home was lost ends (its agent died
        with its home: reward 0, the cause recorded); an episode homed here whose holder was lost ends here,
        unsent (rank 0 starts that trajectory again elsewhere, under a new key)."""
        fenced = set(getattr(getattr(self.rank, "comm", None), "fenced", ()))
        if not fenced - self.fenced_seen:
            return
        self.fenced_seen |= fenced
        for tid, info in list(self.rank.info.items()):
            if info.get("agent") and info["home"] in fenced:
                info["env_error"] = f"agent: its home rank {info['home']} was lost"
                self.end(tid, info)
        for tid, h in list(self.homes.items()):
            if h.holder in fenced:
                self._forget(tid)

    def _forget(self, tid: int) -> None:
        """The home drops an episode that is no longer its to end."""
        self._retire(self.homes.pop(tid))

    def _retire(self, h: Home) -> None:
        """The episode's key is refused from now on; a call in flight (an async agent that did not wait for it)
        is refused; an agent still running (it made too many calls) no longer counts."""
        self.gateway.keys.pop(h.key, None)
        self.gateway.ended.add(h.key)
        if h.http is not None:
            h.http.answer(403, episode_ended())
            h.http = h.call = None
        if self.jobs.pop(h.job, None) is not None:
            self.pool.cancel(h.job)

    def poll(self) -> None:
        """Between engine steps: lost ranks, the agents that returned or failed, then the calls that came in."""
        self.lost()
        self.tell()
        for r in self.pool.poll():
            tid = self.jobs.pop(r.job, None)
            h = self.homes.get(tid) if tid is not None else None
            if h is None or h.job != r.job:
                continue
            if r.error:
                self._end_home(tid, 0.0, "agent: " + r.error.replace(
                    "environment step timed out", "timed out: it ran past env.timeout_s of its own time (between an "
                    "answer and its next call or its return):"))  # "timed out": analyze counts it as timed_out
            elif r.output["metadata"].get("scored_by_task"):
                try:
                    self._end_home(tid, Scorer(h.group_id)(h.reply), "")
                except Exception as e:  # noqa: BLE001 - the task's scorer may raise anything
                    self._end_home(tid, 0.0, f"scorer: {type(e).__name__}: {e}")
            else:
                self._end_home(tid, float(r.output["reward"]), "")
        while not self.gateway.calls.empty():
            self.on_http(self.gateway.calls.get())

    def on_message(self, msg, src: int) -> None:
        match msg:
            case AgentCall():
                self.on_call(msg)
            case AgentTurn():
                self.on_turn(msg)
            case AgentHere():
                self.on_here(msg, src)
            case AgentEnd():
                self.on_end(msg)
            case AgentEnded():
                self.homes.pop(msg.traj_id, None)

    def send(self, msg, dst: int) -> None:
        if dst == self.me:
            self.on_message(msg, dst)
        else:
            self.rank.comm.send(msg, dst)

    def tell(self) -> None:
        """Rank 0's dashboard: how many episodes held here wait on their agent."""
        self.told = tell_waiting(self.rank, self.told, lambda: sum(
            1 for i in self.rank.info.values() if i.get("agent") and i.get("pending") is not None))

    def close(self) -> None:
        for h in self.homes.values():
            if h.http is not None:
                h.http.answer(503, error("the run is shutting down", "server_error"))
        self.gateway.close()
        self.pool.close()


def answer_message(text: str, call_id: str, tools: bool) -> dict[str, Any]:
    """A chat answer as the API's assistant message: with ``tools`` in the episode, the Hermes tool-call
    blocks in ``text`` become ``tool_calls`` (data/tool_calls.py) and the rest its content (None if empty)."""
    content, calls = parse(text, call_id) if tools else (text, [])
    return {"role": "assistant", "content": content} | ({"tool_calls": calls} if calls else {})
