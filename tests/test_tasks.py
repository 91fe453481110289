import time

import pytest
from transformers import AutoTokenizer

from dora_hpc.config import load_config
from dora_hpc.data.tasks import EvenTokensTask, make_task
from dora_hpc.data.text_tasks import JsonlTask, ReasoningGymTask, extract_answer
from dora_hpc.engine.local_models import build_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("m") / "tiny")


def test_reasoning_gym_prompts_are_deterministic_and_scored_by_the_generator(tiny):
    cfg = load_config(None, ["task.name=reasoning_gym", "task.size=50"])
    task = make_task(cfg, 0, tiny)
    assert isinstance(task, ReasoningGymTask) and task.prompt(3) == task.prompt(53)
    tok = task.tok
    answer = task.ds[3]["answer"]
    assert task.safe_reward(3, tok(f"so <answer>{answer}</answer>")["input_ids"]) == (1.0, "")
    assert task.safe_reward(3, tok("<answer>not a number</answer>")["input_ids"])[0] == 0.0


def test_jsonl_skips_malformed_rows_naming_them_and_scores_with_math_verify(tiny, tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"q": "half of 1?", "a": "0.5"}\nnot json\n{"question": "no q field", "a": "1"}\n'
                 '{"q": "2+2?", "a": "4"}\n')
    cfg = load_config(None, ["task.name=jsonl", f"task.path={f}", "task.question_field=q",
                             "task.answer_field=a"])
    task = make_task(cfg, 0, tiny)
    assert isinstance(task, JsonlTask) and len(task.rows) == 2
    assert len(task.malformed) == 2 and f"{f}:2" in task.malformed[0] and f"{f}:3" in task.malformed[1]
    tok = AutoTokenizer.from_pretrained(tiny)
    assert task.safe_reward(0, tok("<answer>\\frac{1}{2}</answer>")["input_ids"])[0] == 1.0
    assert task.safe_reward(1, tok("<answer>5</answer>")["input_ids"])[0] == 0.0
    assert task.question(2) == task.question(0)  # the stream cycles over valid rows
    with pytest.raises(ValueError, match="does not exist"):
        make_task(load_config(None, ["task.name=jsonl", "task.path=/nope.jsonl"]), 0, tiny)


def test_slow_and_raising_scorers_give_zero_with_the_error(tiny):
    cfg = load_config(None, ["task.name=reasoning_gym", "task.size=5", "task.reward_timeout_s=0.2"])

    class Slow(ReasoningGymTask):
        def score(self, group_id, text):
            time.sleep(2)
            return 1.0

    class Raising(ReasoningGymTask):
        def score(self, group_id, text):
            raise RuntimeError("scorer crashed")

    tok = AutoTokenizer.from_pretrained(tiny)
    t = time.time()
    assert Slow(cfg, tok).safe_reward(0, [5, 6]) == (0.0, "reward timed out after 0.2s")
    assert time.time() - t < 1.5
    assert Raising(cfg, tok).safe_reward(0, [5]) == (0.0, "RuntimeError: scorer crashed")


def test_even_tokens_budgets_follow_the_workload():
    cfg = load_config("configs/tiny-cpu.yaml")
    task = EvenTokensTask(cfg, 512)
    budgets = [task.max_tokens(t) for t in range(2000)]
    assert max(budgets) <= 160 and sorted(budgets)[1000] in range(8, 17)
    assert task.prompt(7) == task.prompt(7) and task.reward(0, [2, 4, 5]) == pytest.approx(2 / 3)


def test_extract_answer():
    assert extract_answer("x <answer>1</answer> y <answer> 42 </answer>") == "42"
    assert extract_answer("the end\n 7 ") == "7" and extract_answer("") == ""
    said = "To add 2 and 5 we get 7.\nSo 2 + 5 equals -7.5 here."
    assert extract_answer(said) == "So 2 + 5 equals -7.5 here." and extract_answer(said, "last_number") == "-7.5"
    assert extract_answer("no digits", "last_number") == ""
    assert extract_answer("<answer>3</answer> 4", "last_number") == "3"


def test_reasoning_gym_takes_the_generators_own_settings_and_names_a_bad_one(tiny):
    args = ("task.dataset_args={operators: ['+'], min_terms: 2, max_terms: 2, max_digits: 1, allow_parentheses: false, "
            "allow_negation: false}")
    cfg = load_config(None, ["task.name=reasoning_gym", "task.size=20", args, "task.answer_from=last_number",
                             "task.answer_hint=Add them."])
    task = make_task(cfg, 0, tiny)
    q = task.question(0)
    assert "+" in q and "-" not in q.replace("Calculate", "") and "Add them." in task.tok.decode(task.prompt(0))
    answer = task.ds[0]["answer"]
    assert task.safe_reward(0, task.tok(f"it is {answer}.")["input_ids"]) == (1.0, "")
    with pytest.raises(ValueError, match="task.dataset_args"):
        make_task(load_config(None, ["task.name=reasoning_gym", "task.dataset_args={max_digitz: 1}"]), 0, tiny)


def test_parquet_prompts_read_like_jsonl_with_null_rows_recorded(tiny, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    f = tmp_path / "p.parquet"
    pq.write_table(pa.table({"q": ["half of 1?", "3*3?", None], "a": ["0.5", None, "1"]}), f)
    cfg = load_config(None, ["task.name=jsonl", f"task.path={f}", "task.question_field=q", "task.answer_field=a"])
    task = make_task(cfg, 0, tiny)
    assert task.rows == [("half of 1?", "0.5")]
    assert [m.split(":row ")[1][:1] for m in task.malformed] == ["1", "2"] and "null" in task.malformed[0]
    tok = AutoTokenizer.from_pretrained(tiny)
    assert task.safe_reward(0, tok("<answer>1/2</answer>")["input_ids"])[0] == 1.0
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"not parquet")
    with pytest.raises(ValueError, match="not a readable parquet"):
        make_task(load_config(None, ["task.name=jsonl", f"task.path={bad}"]), 0, tiny)


def test_the_soft_overlong_penalty_ramps_over_the_buffer():
    from dora_hpc.data.tasks import overlong_penalty

    assert [overlong_penalty(n, 100, 20, 1.0) for n in (50, 80, 90, 100, 120)] == [0.0, 0.0, -0.5, -1.0, -1.0]
    assert overlong_penalty(100, 100, 0, 1.0) == 0.0  # off
    assert overlong_penalty(95, 100, 10, 0.4) == pytest.approx(-0.2)
