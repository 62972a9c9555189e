"""Tools: schemas from typed functions, the tag format, errors as observations, the built-ins."""

import shutil
import json
import os
import subprocess
import sys
import tempfile
import textwrap
from fractions import Fraction
from pathlib import Path

import pytest

from tinker_pipelines.envs import sandbox
from tinker_pipelines.envs import EnvError, checked_step
from tinker_pipelines.envs import tools as T
from tinker_pipelines.envs.tool_env import MultiplyEnv
from tinker_pipelines.envs.tools import (
    BUILTIN_TOOLS,
    ToolCall,
    calculator,
    execute_tool_call,
    format_tool_call,
    parse_tool_calls,
    safe_eval_arithmetic,
    tool,
)


def test_schema_from_signature_and_docstring():
    @tool
    def convert(amount: float, currency: str = "EUR", rounded: bool | None = None) -> str:
        """Convert US dollars.

        Args:
            amount: dollars to convert.
            currency: ISO code
                of the target currency.
        """
        return f"{amount}{currency}"

    fn = convert.schema()["function"]
    assert fn["name"] == "convert" and fn["description"] == "Convert US dollars."
    props = fn["parameters"]["properties"]
    assert props["amount"] == {"type": "number", "description": "dollars to convert."}
    assert props["currency"] == {"type": "string", "description": "ISO code of the target currency.", "default": "EUR"}
    assert props["rounded"]["type"] == "boolean"
    assert fn["parameters"]["required"] == ["amount"]
    call = parse_tool_calls(format_tool_call("convert", {"amount": 2}))[0]
    assert execute_tool_call(call, {"convert": convert}).content == "2.0EUR"  # int coerced to number


def test_parse_several_calls_and_text_around():
    text = ("Let me compute. " + format_tool_call("calculator", {"expression": "2*3"}) + " and "
            + format_tool_call("calculator", {"expression": "4+4"}) + " done")
    calls = parse_tool_calls(text)
    assert [(c.name, c.arguments, c.error) for c in calls] == [
        ("calculator", {"expression": "2*3"}, None), ("calculator", {"expression": "4+4"}, None)]
    assert parse_tool_calls("no call here, just 42") == []


@pytest.mark.parametrize("text,message", [
    ("<tool_call>{not json}</tool_call>", "not JSON"),
    ('<tool_call>{"name": "calculator", "arguments": {"expression": "1"}}', "no closing"),
    ("<tool_call>[1, 2]</tool_call>", "must be an object"),
    ('<tool_call>{"arguments": {}}</tool_call>', "must be an object"),
    ('<tool_call>{"name": "calculator", "arguments": [1]}</tool_call>', "'arguments' must be an object"),
    ('<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', "unknown tool 'rm_rf'"),
    ('<tool_call>{"name": "calculator", "arguments": {}}</tool_call>', "missing argument"),
    ('<tool_call>{"name": "calculator", "arguments": {"expression": "1", "x": 2}}</tool_call>', "unknown argument"),
    ('<tool_call>{"name": "calculator", "arguments": {"expression": 5}}</tool_call>', "must be string"),
    ('<tool_call>{"name": "calculator", "arguments": {"expression": "open(1)"}}</tool_call>', "only numbers"),
    ("<tool_call>" + "[" * 100000 + "</tool_call>", "not JSON"),
])
def test_malformed_calls_give_error_results_not_exceptions(text, message):
    calls = parse_tool_calls(text)
    assert len(calls) == 1
    result = execute_tool_call(calls[0], BUILTIN_TOOLS)
    assert not result.ok and result.content.startswith("error:") and message in result.content


def test_a_raising_tool_is_an_error_result():
    @tool
    def broken(x: int) -> int:
        """Always fails."""
        raise KeyError("boom")

    result = execute_tool_call(ToolCall("broken", {"x": 1}), {"broken": broken})
    assert not result.ok and result.content == "error: KeyError: 'boom'"


@pytest.mark.parametrize("expression,value", [
    ("347*829", "287663"), ("347 * 829", "287663"), ("(1 + 2) * 3 / 4", "2.25"), ("2**10", "1024"),
    ("2^10", "1024"), ("-3 + +5", "2"), ("7 // 2", "3"), ("-7 % 3", "2"), ("1/3", "0.3333333333"),
    ("0.1 + 0.2", "0.3"), ("2 ** -2", "0.25"), ("123456789 * 987654321", "121932631112635269"),
])
def test_calculator_is_exact(expression, value):
    assert calculator(expression) == value


@pytest.mark.parametrize("expression", [
    "__import__('os').system('echo hi')", "open('/etc/passwd').read()", "x + 1", "'ab' * 3", "[1, 2]",
    "1 if 1 else 2", "(lambda: 1)()", "1 < 2", "9**9**9", "10**1000", "1/0", "2 ** 0.5", "1e999",
    "().__class__", "1; 2", "1" * 501, "",
])
def test_calculator_refuses_non_arithmetic(expression):
    with pytest.raises(ValueError):
        safe_eval_arithmetic(expression)
    result = execute_tool_call(ToolCall("calculator", {"expression": expression}), BUILTIN_TOOLS)
    assert not result.ok and result.content.startswith("error:")


def test_python_tool_runs_through_the_sandbox(monkeypatch):
    # Where a layer is missing the tool refuses (tested below); the opt-out then runs the same code.
    trusted = bool(sandbox.missing_layers())
    if trusted:
        monkeypatch.setenv(T.TRUSTED_ENV, "1")
    else:
        monkeypatch.delenv(T.TRUSTED_ENV, raising=False)
    real, seen = sandbox.run_python, []

    def spy(code, **kwargs):
        seen.append((code, kwargs))
        return real(code, **kwargs)

    monkeypatch.setattr(sandbox, "run_python", spy)
    ok = execute_tool_call(ToolCall("python", {"code": "print(6 * 7)"}), BUILTIN_TOOLS)
    assert ok.ok and ok.content == "42\n"
    assert seen == [("print(6 * 7)", {"timeout_s": T.PYTHON_TOOL_TIMEOUT_S, "memory_mb": T.PYTHON_TOOL_MEMORY_MB,
                                      "require": () if trusted else sandbox.LAYERS})]
    failed = execute_tool_call(ToolCall("python", {"code": "import sys; print('x'); sys.exit(3)"}), BUILTIN_TOOLS)
    assert not failed.ok and failed.content.startswith("error: exit code 3") and "x" in failed.content
    monkeypatch.setattr(T, "PYTHON_TOOL_TIMEOUT_S", 0.5)
    slow = execute_tool_call(ToolCall("python", {"code": "while True: pass"}), BUILTIN_TOOLS)
    assert not slow.ok and "timed out" in slow.content


def test_tool_env_with_python_is_refused_at_build_when_a_layer_is_missing(monkeypatch):
    probed = []

    def probe(require):
        probed.append(require)
        return {"network_isolated": "unshare(CLONE_NEWNET): Operation not permitted"} if require else {}

    monkeypatch.setattr(T, "_sandbox_missing", probe)
    monkeypatch.delenv(T.TRUSTED_ENV, raising=False)
    with pytest.raises(sandbox.SandboxUnavailable, match=r"network_isolated \(unshare\(CLONE_NEWNET\)") as refused:
        MultiplyEnv(tools=("calculator", "python"))
    assert refused.value.missing == {"network_isolated": "unshare(CLONE_NEWNET): Operation not permitted"}
    assert probed == [sandbox.LAYERS]
    MultiplyEnv(tools=("calculator",))  # no python tool, nothing to refuse
    monkeypatch.setenv(T.TRUSTED_ENV, "1")
    assert "python" in MultiplyEnv(tools=("python",)).tools and probed[-1] == ()


def test_a_refusal_during_an_episode_is_never_shown_to_the_model(monkeypatch):
    monkeypatch.setattr(T, "_sandbox_missing", lambda require: {})  # built while the layers were up

    def refuse(code, **kwargs):
        raise sandbox.SandboxUnavailable({"pid_isolated": "unshare(CLONE_NEWPID): Operation not permitted"})

    env = MultiplyEnv(tools=("python",))
    env.reset(seed=0)
    monkeypatch.setattr(sandbox, "run_python", refuse)
    call = format_tool_call("python", {"code": "print(1)"})
    with pytest.raises(sandbox.SandboxUnavailable):
        execute_tool_call(parse_tool_calls(call)[0], env.tools)
    with pytest.raises(EnvError, match="SandboxUnavailable: .*pid_isolated"):
        checked_step(env, call)


def test_python_tool_without_isolation_refuses_and_runs_nothing():
    """For real: a child process without bubblewrap on its PATH, so no layer can be set up."""
    box = Path(tempfile.mkdtemp(prefix="tool-refusal-"))
    box.chmod(0o1777)
    marker = box / "ran"
    script = textwrap.dedent(f"""
        import json
        from tinker_pipelines.envs.tool_env import MultiplyEnv
        from tinker_pipelines.envs.tools import BUILTIN_TOOLS, ToolCall, execute_tool_call
        from tinker_pipelines.envs.sandbox import SandboxUnavailable
        out = {{}}
        for what, attempt in (
                ("build", lambda: MultiplyEnv(tools=("python",)).tools),
                ("call", lambda: execute_tool_call(ToolCall("python", {{"code": "open({str(marker)!r}, 'w')"}}),
                                                   BUILTIN_TOOLS).ok)):
            try:
                out[what] = repr(attempt())
            except SandboxUnavailable as exc:
                out[what] = exc.missing
        print(json.dumps(out))
    """)
    no_bwrap = Path(tempfile.mkdtemp(prefix="no-bwrap-"))
    env = {**{k: v for k, v in os.environ.items() if k != T.TRUSTED_ENV}, "PATH": str(no_bwrap),
           "PYTHONPATH": str(Path(__file__).resolve().parents[1])}

    def child(**extra: str) -> dict:
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                              env={**env, **extra})
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    try:
        refused = child()
        assert set(refused["build"]) == set(refused["call"]) == set(sandbox.LAYERS), refused
        assert refused["call"]["network_isolated"].startswith("bubblewrap (bwrap) is not installed")
        assert not marker.exists()
        trusted = child(**{T.TRUSTED_ENV: "1"})  # the same call, opted out: it runs, so the check above can fail
        assert trusted["call"] == "True" and marker.exists()
    finally:
        marker.unlink(missing_ok=True)
        box.rmdir()
        no_bwrap.rmdir()


def test_tool_env_turns_and_errors():
    env = MultiplyEnv(split="test")
    opening = env.reset(seed=5)
    assert "calculator" in opening[0]["content"] and opening[1]["content"].startswith("What is ")
    a, b = (int(x) for x in opening[1]["content"][8:-1].split(" * "))
    bad = env.step("<tool_call>{oops</tool_call>")
    assert not bad.done and bad.reward == 0.0 and bad.observation[0]["role"] == "tool"
    assert bad.observation[0]["content"].startswith("error: the call is not JSON")
    good = env.step(format_tool_call("calculator", {"expression": f"{a}*{b}"}))
    assert good.observation == [{"role": "tool", "content": str(a * b)}]
    final = env.step(f" {a * b}\n")
    assert final.done and final.reward == 1.0 and final.info["tool_calls"] == 2 and final.info["tool_errors"] == 1
    with pytest.raises(RuntimeError):
        env.step("1")


def test_tool_budget_and_no_tool_variant():
    env = MultiplyEnv(max_tool_calls=1, tool_role="user")
    env.reset(seed=1)
    call = format_tool_call("calculator", {"expression": "1+1"})
    assert env.step(call).observation[0]["role"] == "user"
    over = env.step(call)
    assert over.done and over.reward == 0.0 and over.info["stop"] == "tool_budget"
    plain = MultiplyEnv(tools=())
    assert "Tools" not in plain.reset(seed=1)[0]["content"]
    result = plain.step(call)  # without tools a call is just a (wrong) final answer
    assert result.done and result.reward == 0.0


def test_sft_examples_are_consistent():
    pairs = MultiplyEnv.sft_examples(6, seed=0)
    for messages, reply in pairs:
        if messages[-1]["role"] == "tool":
            assert reply == messages[-1]["content"] == calculator(parse_tool_calls(messages[-2]["content"])[0].arguments["expression"])
        else:
            a, b = messages[-1]["content"][8:-1].split(" * ")
            assert reply == format_tool_call("calculator", {"expression": f"{a} * {b}"})
    assert Fraction(calculator("6/4")) == Fraction(3, 2)


_TOOLS_RUN = """
import json, os, tempfile
from tinker_pipelines.config import config_from_dict
from tinker_pipelines.envs.tool_env import MultiplyEnv
from tinker_pipelines.envs.tools import format_tool_call
from tinker_pipelines.loops.train import train

env = MultiplyEnv(tools=("calculator", "python"))  # its build runs the sandbox's preflight
env.reset(seed=0)
seen = env.step(format_tool_call("python", {"code": "import os; print(6 * 7, os.getuid())"})).observation
cfg = config_from_dict({
    "seed": 0, "output_dir": tempfile.mkdtemp(),
    "env": {"path": "multiply_tools", "kwargs": {"tools": ["calculator", "python"]}},
    "algorithm": {"name": "ppo", "ppo_epochs": 1},
    "training": {"mode": "lora", "iterations": 2, "groups_per_batch": 2, "group_size": 2, "max_new_tokens": 8},
    "eval": {"every": 2, "num_tasks": 2}})
metrics = list(train(cfg))
print(json.dumps({"uid": os.getuid(), "tool": seen[0]["content"], "iterations": len(metrics)}))
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="running unprivileged already")
def test_tool_env_and_its_ppo_run_work_as_an_unprivileged_user():
    """uid 65534: the python tool runs with every sandbox layer, and two PPO iterations complete."""
    from tests.unprivileged import run_as_unprivileged, world_readable_copy

    copy = world_readable_copy(["test_tools.py", "conftest.py"])
    try:
        run = run_as_unprivileged(["python", "-c", _TOOLS_RUN], copy)
        suite = run_as_unprivileged(["python", "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                     "tests/test_tools.py"], copy)
    finally:
        shutil.rmtree(copy)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    # uid 65534 outside; uid 1000 inside: the sandbox's, every layer up
    assert out == {"uid": 65534, "tool": "42 1000\n", "iterations": 2}
    assert suite.returncode == 0 and "1 skipped" in suite.stdout.splitlines()[-1], suite.stdout[-3000:] + suite.stderr[-2000:]
