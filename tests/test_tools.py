"""Tools: schemas from typed functions, the tag format, errors as observations, the built-ins."""

from fractions import Fraction

import pytest

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
    import tinker_pipelines.sandbox as sandbox

    real, seen = sandbox.run_python, []

    def spy(code, **kwargs):
        seen.append((code, kwargs))
        return real(code, **kwargs)

    monkeypatch.setattr(sandbox, "run_python", spy)
    ok = execute_tool_call(ToolCall("python", {"code": "print(6 * 7)"}), BUILTIN_TOOLS)
    assert ok.ok and ok.content == "42\n"
    assert seen == [("print(6 * 7)", {"timeout_s": T.PYTHON_TOOL_TIMEOUT_S, "memory_mb": T.PYTHON_TOOL_MEMORY_MB})]
    failed = execute_tool_call(ToolCall("python", {"code": "import sys; print('x'); sys.exit(3)"}), BUILTIN_TOOLS)
    assert not failed.ok and failed.content.startswith("error: exit code 3") and "x" in failed.content
    monkeypatch.setattr(T, "PYTHON_TOOL_TIMEOUT_S", 0.5)
    slow = execute_tool_call(ToolCall("python", {"code": "while True: pass"}), BUILTIN_TOOLS)
    assert not slow.ok and "timed out" in slow.content


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
