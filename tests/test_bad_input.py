"""Bad input fails early with an error that names the field, the environment, the tool, the
algorithm or the bucket; each test is a row of docs/bad_input.md (the command line's rows are in
test_cli_errors.py)."""

import math

import pytest
from conftest import moto_s3
import torch

from tinker_pipelines.config import ConfigError, config_from_dict, load_config
from tinker_pipelines.envs import Env, EnvError, EnvSpec
from tinker_pipelines.models import stop_token_ids
from tinker_pipelines.rollout.episodes import RolloutConfig, run_groups
from tinker_pipelines.rollout.sampler import ContextOverflowError, Sampler
from tinker_pipelines.types import StepResult


@pytest.mark.parametrize("patch,message", [
    ({"algorithm": {"name": "reinforce9"}}, "algorithm.name 'reinforce9'"),
    ({"model": {"name": "gpt-17"}}, "model.name 'gpt-17'"),
    ({"env": {"path": "no_such.module:Env"}}, "env.path 'no_such.module:Env'"),
    ({"env": {"path": "tinker_pipelines.types:Datum"}}, "not a subclass"),
    ({"env": {"path": "arithmetic-without-colon"}}, "env.path"),
    ({"algorithm": {"clip_eps": -0.2}}, "algorithm.clip_eps must be > 0, got -0.2"),
    ({"training": {"learning_rate": 0}}, "training.learning_rate must be positive"),
    ({"training": {"learning_rate": -1e-3}}, "training.learning_rate must be positive"),
    ({"training": {"group_size": 1}}, "training.group_size must be >= 2 for grpo"),
    ({"training": {"mode": "qlora"}}, "training.mode"),
    ({"training": {"learning_rte": 1e-3}}, "unknown field training.learning_rte"),
    ({"training": {"iterations": "ten"}}, "training.iterations must be int"),
    ({"algorithm": {"kl_estimator": "k7"}}, "algorithm.kl_estimator"),
    ({"training": []}, "training must be a mapping, got list"),
    ({"training": False}, "training must be a mapping, got bool"),
    ({1: 2, "foo": 3}, "unknown field 1"),
    ({"model": {"name": "tiny", "kwargs": {"hiden": 3}}}, "model.kwargs.hiden is not an argument of tiny"),
    ({"model": {"name": "tiny", "kwargs": {"hidden_size": -1}}}, "model.kwargs.hidden_size must be an integer >= 1"),
    ({"model": {"name": "tiny", "kwargs": {"hidden_size": 130}}}, "model.kwargs.hidden_size must be a multiple of 4"),
    ({"model": {"name": "smollm2-135m-instruct", "kwargs": {"hidden_size": 64}}}, "takes no builder arguments"),
    ({"sft": {"batch_size": 0}}, "sft.batch_size must be >= 1"),
    ({"sft": {"examples": 0}}, "sft.examples must be >= 1"),
    ({"sft": {"learning_rate": math.inf}}, "sft.learning_rate must be positive"),
    ({"training": {"temperature": math.inf}}, "training.temperature must be positive"),
    ({"training": {"lora_alpha": -16}}, "training.lora_alpha must be positive"),
    ({"output_dir": ""}, "output_dir must be a path (not empty)"),
    ({"model": {"dtype": "float16"}}, "model.dtype cannot be float16 for training (no loss scaling"),
    ({"model": {"dtype": "fp16"}}, "use bfloat16"),
])
def test_bad_config_names_the_field(patch, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        config_from_dict(patch)


def test_bad_config_fails_before_any_model_loads(monkeypatch):
    import tinker_pipelines.loops.experiment as experiment
    from tinker_pipelines.loops.train import Experiment

    def boom(*a, **k):
        raise AssertionError("a model was loaded")

    # the name Experiment calls (patching tinker_pipelines.models would miss it, or leak into
    # every later test when this import is the first)
    monkeypatch.setattr(experiment, "load_model", boom)

    cfg = config_from_dict({})
    bad = cfg.__class__(**{**cfg.__dict__, "training": cfg.training.__class__(learning_rate=-1.0)})
    with pytest.raises(ConfigError, match="training.learning_rate"):
        Experiment(bad)


def _gpu_without_bf16(monkeypatch):
    """A machine with two pre-Ampere GPUs (the hardware we lack here: torch.cuda's answers for it)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda dev=None: (7, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda dev=None: "Tesla V100-SXM2-16GB")


def test_bf16_on_a_gpu_without_bf16_names_the_device(monkeypatch):
    _gpu_without_bf16(monkeypatch)
    with pytest.raises(ConfigError, match=r"model.dtype bfloat16 is not supported natively by cuda:1 "
                                          r"\(Tesla V100-SXM2-16GB, compute capability < 8.0\): use float32"):
        config_from_dict({"model": {"device": "cuda:1", "dtype": "bfloat16"}})
    # 'auto' picks fp32 there rather than torch's emulated bf16
    from tinker_pipelines.models import resolve_dtype

    assert resolve_dtype("auto", "cuda:1") == torch.float32 and resolve_dtype("float32", "cuda:1") == torch.float32


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    (tmp_path / "empty.yaml").write_text("")
    with pytest.raises(ConfigError, match="is empty"):
        load_config(tmp_path / "empty.yaml")
    (tmp_path / "list.yaml").write_text("[]\n")
    with pytest.raises(ConfigError, match="config must be a mapping, got list"):
        load_config(tmp_path / "list.yaml")
    (tmp_path / "bin.yaml").write_bytes(b"\xff\xfe")
    with pytest.raises(ConfigError, match="is not UTF-8 text"):
        load_config(tmp_path / "bin.yaml")
    with pytest.raises(ConfigError, match="is a directory"):
        load_config(tmp_path)


class CrashingEnv(Env):
    def reset(self, seed=None):
        self._seed = seed
        return [{"role": "user", "content": "hi"}]

    def step(self, action):
        raise KeyError("the env has a bug")


class NaNRewardEnv(CrashingEnv):
    def step(self, action):
        return StepResult([], math.nan, True)


class InfRewardEnv(CrashingEnv):
    def step(self, action):
        return StepResult([], -math.inf, True)


class StringRewardEnv(CrashingEnv):
    def step(self, action):
        return StepResult([], "1.0", True)


class StringStepEnv(CrashingEnv):
    def step(self, action):
        return "correct!"


class TupleStepEnv(CrashingEnv):
    def step(self, action):
        return [], 1.0, True, {}


class StringObservationEnv(CrashingEnv):
    def step(self, action):
        return StepResult("try again", 0.0, False)


class ResetCrashEnv(CrashingEnv):
    def reset(self, seed=None):
        raise FileNotFoundError("tasks.jsonl")


class StringResetEnv(CrashingEnv):
    def reset(self, seed=None):
        return "What is 2 + 2?"


class HugeRewardEnv(CrashingEnv):
    def step(self, action):
        return StepResult([], 1e308, True)


class StringDoneEnv(CrashingEnv):
    def step(self, action):
        return StepResult([], 1.0, "yes")


class StringInfoEnv(CrashingEnv):
    def step(self, action):
        return StepResult([], 1.0, True, "solved")


class ExitingEnv(CrashingEnv):
    def step(self, action):
        raise SystemExit(3)


class CtorCrashEnv(CrashingEnv):
    def __init__(self, level: int = 1):
        self.level = 1 / (level - 1)


@pytest.mark.parametrize("env_cls,message", [
    (CrashingEnv, "CrashingEnv raised in step(): KeyError: 'the env has a bug'"),
    (NaNRewardEnv, "NaNRewardEnv returned a non-finite reward nan"),
    (InfRewardEnv, "InfRewardEnv returned a non-finite reward -inf"),
    (StringRewardEnv, "StringRewardEnv.step() returned reward '1.0' of type str; a reward must be a float"),
    (StringStepEnv, "StringStepEnv.step() returned str 'correct!', not StepResult"),
    (TupleStepEnv, "TupleStepEnv.step() returned tuple ([], 1.0, True, {}), not StepResult (a Gym-style tuple?"),
    (StringObservationEnv, "StringObservationEnv.step() returned an observation of type str, not a list of messages"),
    (ResetCrashEnv, "ResetCrashEnv raised in reset(): FileNotFoundError: tasks.jsonl"),
    (StringResetEnv, "StringResetEnv.reset() returned str 'What is 2 + 2?', expected a non-empty list"),
    (CtorCrashEnv, f"CtorCrashEnv ('{__name__}:CtorCrashEnv') raised in its constructor: ZeroDivisionError"),
    (HugeRewardEnv, "HugeRewardEnv returned reward 1e+308, outside the float32 range"),
    (StringDoneEnv, "StringDoneEnv.step() returned done='yes' of type str; done must be a bool"),
    (StringInfoEnv, "StringInfoEnv.step() returned info of type str, not a dict"),
    (ExitingEnv, "ExitingEnv raised in step(): SystemExit: 3"),
], ids=lambda v: v.__name__ if isinstance(v, type) else "message")
def test_env_failures_are_reported_naming_the_env(_tiny_pristine, env_cls, message):
    model, tok = _tiny_pristine  # sampling only reads the weights: no copy per case
    sampler = Sampler(model, tok.pad_token_id, stop_token_ids(tok))
    spec = EnvSpec(f"{__name__}:{env_cls.__name__}")
    with pytest.raises(EnvError) as e:
        run_groups(sampler, tok, spec, [0], 2, RolloutConfig(max_new_tokens=2, max_turns=2),
                   torch.Generator().manual_seed(0))
    assert message in str(e.value)


def test_env_kwargs_that_the_constructor_does_not_take():
    with pytest.raises(ValueError, match=r"env.kwargs \{'levle': 2\} do not fit .*CtorCrashEnv.*'levle'"):
        EnvSpec(f"{__name__}:CtorCrashEnv", {"levle": 2}).build()
    with pytest.raises(ValueError, match=r"env.kwargs.tools: unknown tool\(s\) \['abacus'\]"):
        EnvSpec("multiply_tools", {"tools": ["abacus"]}).build()


def test_env_constructor_refusal_comes_before_any_model_loads(monkeypatch):
    import tinker_pipelines.loops.experiment as experiment

    def boom(*a, **k):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(experiment, "load_model", boom)
    cfg = config_from_dict({"env": {"path": "multiply_tools", "kwargs": {"tools": ["abacus"]}}})
    with pytest.raises(ValueError, match=r"unknown tool\(s\) \['abacus'\]"):
        experiment.Experiment(cfg)


def test_prompt_longer_than_context(tiny):
    model, tok = tiny
    sampler = Sampler(model, tok.pad_token_id, stop_token_ids(tok), max_context=32)
    with pytest.raises(ContextOverflowError, match="exceeds the model context of 32"):
        sampler.sample([[5] * 30], max_new_tokens=8)
    spec = EnvSpec("arithmetic")
    with pytest.raises(ContextOverflowError, match="ArithmeticEnv .*exceeds the model context of 32"):
        run_groups(sampler, tok, spec, [0], 2, RolloutConfig(max_new_tokens=8))


class TalkativeEnv(CrashingEnv):
    """Answers every reply with `words` more words and never ends the episode itself."""

    words = 3

    def step(self, action):
        return StepResult([{"role": "user", "content": "more " * self.words}], 0.25, False)


class FloodingEnv(TalkativeEnv):
    words = 2000


@pytest.mark.parametrize("env_cls,turns,stop", [(TalkativeEnv, 3, "max_turns"), (FloodingEnv, 1, "context_overflow")])
def test_long_episodes_end_and_keep_their_turns(tiny, env_cls, turns, stop):
    """A never-ending episode is cut at max_turns; an observation that overflows the context ends
    the episode there: both keep the turns played so far (no error, nothing lost)."""
    model, tok = tiny
    sampler = Sampler(model, tok.pad_token_id, stop_token_ids(tok))
    [group] = run_groups(sampler, tok, EnvSpec(f"{__name__}:{env_cls.__name__}"), [0], 2,
                         RolloutConfig(max_new_tokens=2, max_turns=3), torch.Generator().manual_seed(0))
    for t in group.trajectories:
        assert t.stop_reason == stop and len(t.turns) == turns and t.total_reward == pytest.approx(0.25 * turns)


# -- malformed tool calls: an error the model reads, never an exception ---------------------------

@pytest.mark.parametrize("reply,message", [
    ('<tool_call>{"name": calculator}</tool_call>', "error: the call is not JSON"),
    ('<tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}}', "error: the call has no closing"),
    ("<tool_call>[1, 2]</tool_call>", 'error: the call must be an object {"name": ..., "arguments": {...}}'),
    ('<tool_call>{"name": "calculator", "arguments": [1]}</tool_call>', "error: 'arguments' must be an object"),
    ('<tool_call>{"name": "abacus", "arguments": {}}</tool_call>', "error: unknown tool 'abacus'; available: calculator"),
    ('<tool_call>{"name": "calculator", "arguments": {}}</tool_call>', "error: missing argument(s) ['expression']"),
    ('<tool_call>{"name": "calculator", "arguments": {"expression": 7}}</tool_call>',
     "error: TypeError: argument 'expression' must be string, got int"),
    ('<tool_call>{"name": "calculator", "arguments": {"expression": "__import__(\'os\')"}}</tool_call>',
     "error: ValueError: only numbers and + - * / // % ** ( ) are allowed, not Call"),
    ('<tool_call>{"name": "calculator", "arguments": {"expression": "1/0"}}</tool_call>',
     "error: ValueError: division by zero"),
])
def test_malformed_tool_calls(reply, message):
    from tinker_pipelines.envs.tool_env import MultiplyEnv
    from tinker_pipelines.envs.tools import BUILTIN_TOOLS, execute_tool_call, parse_tool_calls

    [call] = parse_tool_calls(reply)
    result = execute_tool_call(call, {"calculator": BUILTIN_TOOLS["calculator"]})
    assert not result.ok and result.content.startswith(message)
    env = MultiplyEnv()  # the env hands the same error to the model as a tool message
    env.reset(seed=0)
    out = env.step(reply)
    assert not out.done and out.observation[-1]["content"].startswith(message)


# -- algorithm registry ---------------------------------------------------------------------------

def other_grpo_loss(*args, **kwargs):
    raise AssertionError("never called")


def test_register_algorithm_refuses_a_taken_name():
    from tinker_pipelines.algorithms.registry import ALGORITHMS, Algorithm, get_algorithm, register_algorithm

    grpo = get_algorithm("grpo")
    with pytest.raises(ValueError, match=r"algorithm name 'grpo' is already registered with loss "
                                         r"tinker_pipelines.algorithms.losses.grpo_loss; register "
                                         rf"{__name__}.other_grpo_loss under another name"):
        register_algorithm(Algorithm("grpo", other_grpo_loss, "group_normalized", 2))
    assert get_algorithm("grpo") is grpo  # the config that names grpo still trains grpo
    assert register_algorithm(Algorithm("grpo", grpo.loss, "group_normalized", 2)).loss is grpo.loss  # same again: fine
    with pytest.raises(ValueError, match="algorithm 'mine': unknown advantage estimator 'z_score'; known: "):
        register_algorithm(Algorithm("mine", other_grpo_loss, "z_score", 2))
    assert "mine" not in ALGORITHMS


def test_register_algorithm_replaces_a_name_only_when_told():
    from tinker_pipelines.algorithms.registry import ALGORITHMS, Algorithm, get_algorithm, register_algorithm

    grpo = get_algorithm("grpo")
    register_algorithm(Algorithm("mine_told", grpo.loss, "group_normalized", 2))
    with pytest.raises(ValueError, match=r"under another name \(or pass overwrite=True\)"):
        register_algorithm(Algorithm("mine_told", other_grpo_loss, "group_normalized", 2))
    try:
        register_algorithm(Algorithm("mine_told", other_grpo_loss, "group_normalized", 2), overwrite=True)
        assert get_algorithm("mine_told").loss is other_grpo_loss
    finally:
        ALGORITHMS.pop("mine_told", None)


# -- the S3 artifact store against a real S3-compatible server (moto's, as in test_s3.py) ---------

@pytest.fixture(scope="module")
def s3_url():
    with moto_s3("bad-input") as url:
        yield url


def test_s3_bucket_that_does_not_exist(s3_url, tmp_path):
    from tinker_pipelines.tracking.store import ArtifactStoreError, open_store

    store = open_store("s3://no-such-bucket/runs", endpoint_url=s3_url, cache_dir=tmp_path)
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "record.json").write_text("{}")
    for call in (lambda: store.put_bytes("a", b"x"), lambda: store.exists("a"), lambda: store.get_bytes("a"),
                 lambda: store.put_dir(tmp_path / "ckpt", "c"), lambda: store.local_dir("c")):
        with pytest.raises(ArtifactStoreError, match=f"S3 bucket 'no-such-bucket' does not exist .*{s3_url}"):
            call()
    with pytest.raises(FileNotFoundError, match="no object 's3://bad-input/runs/nothing' in the artifact store"):
        open_store("s3://bad-input/runs", endpoint_url=s3_url).get_bytes("nothing")


def test_s3_bad_or_missing_credentials(s3_url, tmp_path, monkeypatch):
    import moto.settings
    from botocore.config import Config

    from tinker_pipelines.tracking.store import ArtifactStoreError, open_store

    good = open_store("s3://bad-input/creds", endpoint_url=s3_url, cache_dir=tmp_path)
    good.put_bytes("kept", b"saved before")
    monkeypatch.setattr(moto.settings, "INITIAL_NO_AUTH_ACTION_COUNT", 0)  # the server checks keys from now on
    bad = open_store("s3://bad-input/creds", endpoint_url=s3_url, cache_dir=tmp_path,
                     aws_access_key_id="AKIAWRONGWRONGWRONG", aws_secret_access_key="wrong")
    for call in (lambda: bad.put_bytes("b", b"x"), lambda: bad.get_bytes("kept"), lambda: bad.exists("kept")):
        with pytest.raises(ArtifactStoreError, match="S3 refused the credentials for s3://bad-input .*InvalidAccessKeyId"):
            call()
    monkeypatch.setattr(moto.settings, "INITIAL_NO_AUTH_ACTION_COUNT", float("inf"))
    assert good.get_bytes("kept") == b"saved before" and not good.exists("b")
    closed = open_store("s3://bad-input/x", endpoint_url="http://127.0.0.1:9", config=Config(retries={"max_attempts": 1}))
    with pytest.raises(ArtifactStoreError, match="cannot reach the S3 endpoint for s3://bad-input at http://127.0.0.1:9"):
        closed.exists("a")
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE"):
        monkeypatch.delenv(k, raising=False)
    for k in ("AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE"):
        monkeypatch.setenv(k, str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    import boto3

    monkeypatch.setattr(boto3, "DEFAULT_SESSION", None)  # a fresh process's session: credentials looked up anew
    with pytest.raises(ArtifactStoreError, match="no usable AWS credentials for s3://bad-input"):
        open_store("s3://bad-input/creds", endpoint_url=s3_url).put_bytes("c", b"x")
