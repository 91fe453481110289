import pytest

from dora_hpc.cli import main
from dora_hpc.config import ConfigError, load_config, with_overrides


def test_defaults_and_repo_configs_validate():
    cfg = load_config()
    assert cfg.batch.rbs >= cfg.batch.tbs
    for path in ("configs/sim/small.yaml", "configs/sim/paper-64.yaml", "configs/sim/paper-128.yaml"):
        load_config(path)


def test_overrides_parse_values_and_reach_nested_keys():
    cfg = load_config("configs/sim/small.yaml", ["dora.k=3", "workload.response_len.sigma=1.5", "mode=sync"])
    assert cfg.dora.k == 3 and cfg.workload.response_len.sigma == 1.5 and cfg.mode == "sync"
    assert with_overrides(cfg, {"cluster.rollout_instances": 3}).cluster.rollout_instances == 3


@pytest.mark.parametrize("override, key", [
    ("batch.rbs=1", "batch"),                       # rbs < tbs
    ("dora.kk=1", "dora.kk"),                       # unknown key
    ("dora.k=-1", "dora.k"),
    ("workload.response_len.median=0", "workload.response_len.median"),
    ("cluster.rollout_instances=100", "cluster"),   # no accelerator left for training
    ("mode=fast", "mode"),
    ("cluster.placement.dora=everywhere", "cluster.placement.dora"),
    ("train.tensor_parallel=2", "train.tensor_parallel"),   # for the megatron backend only
    ("train.backend=deepspeed", "train.backend"),
    ("engine.tensor_parallel=2", "engine.tensor_parallel"),  # vLLM instances only
    ("train.mixed_precision=fp16", "train.mixed_precision"),
    ("engine.dtype=bfloat16", "engine.dtype"),
    ("runtime.hang_timeout_s=1", "runtime"),       # shorter than 3 heartbeats
    ("engine.dtype=fp8", "engine.dtype"),
    ("train.mini_batches=99", "train.mini_batches"),  # more than batch.tbs
    ("batch.rbs=lots", "batch.rbs"),                # an int or auto
    ("train.is_level=group", "train.is_level"),     # token or sequence
    ("train.publish_dtype=float16", "train.publish_dtype"),
    ("sim.hardware.delta_ratio=0", "sim.hardware.delta_ratio"),  # a share of the bytes, in (0, 1]
])
def test_bad_values_name_the_key(override, key):
    with pytest.raises(ConfigError) as e:
        load_config("configs/sim/small.yaml", [override])
    assert key in str(e.value)


@pytest.mark.parametrize("sets, says", [
    (["env.listen=nowhere"], "env.listen"),
    (["env.name=openai_agent"], "env.args.agent"),                                  # no agent named
    (["env.name=openai_agent", "env.args={agent: 'no_such_module:f'}"], "env.args.agent: cannot import"),
    (["env.name=openai_agent", "env.args={agent: 'dora_hpc.envs.agents:retry'}"], "env.workers"),  # < slots
    (["env.name=openai_agent", "env.args={agent: 'dora_hpc.envs.agents:retry'}", "env.workers=8",
      "cluster.elastic=true"], "cluster.elastic"),
])
def test_agent_settings_are_checked_when_the_config_loads(sets, says):
    with pytest.raises(ConfigError) as e:
        load_config("configs/tiny-cpu.yaml", sets)
    assert says in str(e.value)


@pytest.mark.parametrize("sets", [["train.shared_prompt=true", "train.backend=megatron"],
                                  ["train.shared_prompt=true", "train.activation_checkpointing=true"]])
def test_a_shared_prompt_forward_is_refused_where_it_cannot_run(sets):
    with pytest.raises(ConfigError, match="train.shared_prompt"):
        load_config("configs/tiny-cpu.yaml", sets)


@pytest.mark.parametrize("sets, says", [
    (["train.replicas=2"], "must divide cluster.trainer_ranks"),
    (["train.replicas=2", "cluster.trainer_ranks=2", "train.backend=fsdp"], "nothing to shard"),
    (["train.replicas=2", "cluster.trainer_ranks=4"], "train.backend=fsdp"),
    (["train.replicas=2", "cluster.trainer_ranks=4", "train.backend=megatron", "train.tensor_parallel=1"],
     "one tensor-parallel group"),
    (["train.replicas=2", "cluster.trainer_ranks=2", "train.backend=megatron"], "nothing to shard"),
    (["train.replicas=2", "cluster.trainer_ranks=2", "cluster.elastic=true"], "cluster.elastic"),
    (["train.replicas=0"], "train.replicas"),
])
def test_trainer_replicas_are_refused_where_they_cannot_run_yet(sets, says):
    with pytest.raises(ConfigError) as e:
        load_config("configs/tiny-cpu.yaml", sets)
    assert "train.replicas" in str(e.value) and says in str(e.value)


def test_float32_publishing_needs_a_float32_engine():
    """An engine in bfloat16 cannot hold float32 weights, so their checksum could never hold after a load."""
    vllm_bf16 = ["engine.backend=vllm", "engine.dtype=bfloat16"]
    with pytest.raises(ConfigError, match="train.publish_dtype=float32 needs engine.dtype=float32"):
        load_config("configs/sim/small.yaml", [*vllm_bf16, "train.publish_dtype=float32"])
    assert load_config("configs/sim/small.yaml", vllm_bf16).train.publish_dtype == "auto"  # bfloat16, as the engine


def test_rbs_auto_is_for_the_streaming_modes():
    assert load_config("configs/sim/small.yaml", ["batch.rbs=auto"]).batch.rbs == "auto"
    assert load_config("configs/sim/small.yaml", ["batch.rbs=auto", "mode=partial"]).batch.rbs == "auto"
    with pytest.raises(ConfigError, match="batch.rbs: auto needs a streaming mode"):
        load_config("configs/sim/small.yaml", ["batch.rbs=auto", "mode=oversample"])


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("batch: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    bad.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(bad)
    with pytest.raises(ConfigError, match="dotted.key=value"):
        load_config(None, ["novalue"])


def test_cli_exits_2_naming_the_key(tmp_path, capsys):
    code = main(["simulate", "configs/sim/small.yaml", "--set", "batch.tbs=0", "--out", str(tmp_path)])
    assert code == 2
    assert "batch.tbs" in capsys.readouterr().err
    assert main(["simulate", "configs/sim/small.yaml", "--modes", "dora,warp", "--out", str(tmp_path)]) == 2
    capsys.readouterr()
    # the message is text, not rich markup: a path with brackets reaches the user whole, on one line
    assert main(["simulate", str(tmp_path / "[exp1]" / "c.yaml"), "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path}/[exp1]/c.yaml does not exist" in err and err.count("\n") == 1, err


def test_deprecated_keys_keep_working_and_name_their_new_key(tmp_path, capsys):
    """cluster.rollout_ranks -> cluster.rollout_instances and dora.kv_offload -> engine.on_kv_full: one
    release of grace, a message naming the new key; both names disagreeing is an error naming both."""
    from dora_hpc.config import ConfigError, load_config, validate

    cfg = load_config("configs/tiny-cpu.yaml", ["cluster.rollout_ranks=2", "dora.kv_offload=false"])
    assert cfg.cluster.rollout_instances == 2 and cfg.engine.on_kv_full == "recompute"
    err = capsys.readouterr().err
    assert "cluster.rollout_ranks is deprecated: use cluster.rollout_instances" in err
    assert "dora.kv_offload is deprecated: use engine.on_kv_full" in err
    old = tmp_path / "old.yaml"
    old.write_text("cluster: {rollout_ranks: 2, rollout_instances: 3}\n")
    with pytest.raises(ConfigError, match="cluster.rollout_ranks.*cluster.rollout_instances"):
        load_config(old)
    # a run of an older release saved both (they could differ): its runtime's key wins, silently
    saved = {"cluster": {"rollout_ranks": 2, "rollout_instances": 3},
             "dora": {"kv_offload": False}, "engine": {"on_kv_full": "offload"}}
    cfg = validate(saved, saved=True)
    assert cfg.cluster.rollout_instances == 2 and cfg.engine.on_kv_full == "offload"


def test_a_bare_no_is_float32_training_not_a_yaml_false():
    """``--set train.mixed_precision=no``, as the trainer's bf16 warning says, and ``mixed_precision: no`` in YAML."""
    assert load_config("configs/smollm2-addition.yaml", ["train.mixed_precision=no"]).train.mixed_precision == "no"
