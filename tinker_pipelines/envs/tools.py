"""Tools for agents: plain typed Python functions, a call format, a parser and the built-ins.

A tool is an ordinary function with type hints and a docstring; `tool(fn)` derives its JSON
schema (name, description, parameters) from them:

    @tool
    def lookup(word: str, limit: int = 3) -> str:
        '''Find a word in the dictionary.

        Args:
            word: the word to look up.
            limit: how many senses to return.
        '''

**Call format.** Models without a native tool-call format (the tiny model, SmolLM2) call a tool
by writing, anywhere in their reply,

    <tool_call>{"name": "calculator", "arguments": {"expression": "12 * 34"}}</tool_call>

one JSON object per tag, several tags allowed. This is the Hermes / Qwen2.5 convention, so models
trained on that format use it unchanged. The result goes back to the model as a message with role
`tool` (see `ToolEnv`). Nothing the model writes can crash the environment: a tag that does not
parse, an unknown tool, missing or ill-typed arguments, or a tool that raises all give a
`ToolResult` with `ok=False` whose text starts with `error:` and says what was wrong, so the
model can see and learn from its mistake.

Built in: `calculator` (exact arithmetic from a parsed syntax tree; never `eval`) and `python`
(runs code through `tinker_pipelines.envs.sandbox.run_python`, only with every isolation layer of the
sandbox up; `TINKER_SANDBOX_TRUSTED=1` opts out, for trusted code only). A missing layer is the
machine's fault, not the model's: it raises `SandboxUnavailable` from the tool's `preflight`
(which `ToolEnv` runs when it is built) and from the call itself, and is never shown to the model.
"""

from __future__ import annotations

import ast
import functools
import inspect
import json
import math
import operator
import os
import re
import types
import typing
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Callable

from tinker_pipelines.envs import sandbox
from tinker_pipelines.envs.sandbox import SandboxUnavailable

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
_TAG_RE = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)" + re.escape(TOOL_CALL_CLOSE), re.DOTALL)
_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object"}


class ToolError(Exception):
    """Raised by a tool to report a failure to the model (shown as `error: <message>`)."""


@dataclass(frozen=True)
class Tool:
    """A callable tool and the schema the model is shown."""

    name: str
    """How the model calls it."""
    description: str
    """What it does (the docstring's first paragraph)."""
    parameters: dict[str, Any]
    """JSON schema of the arguments: {'type': 'object', 'properties': ..., 'required': [...]}."""
    fn: Callable[..., Any]
    """The function; its return value is shown to the model with `str()`."""
    preflight: Callable[[], None] | None = None
    """Checks, before any episode, that the tool can work on this machine; raises if not."""

    def schema(self) -> dict[str, Any]:
        """The OpenAI-style function schema, as chat templates with native tool support take it."""
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)


@dataclass(frozen=True)
class ToolCall:
    """One parsed call, or the reason it could not be parsed (`error` is then set)."""

    name: str = ""
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    raw: str = ""
    """The text between the tags."""


@dataclass(frozen=True)
class ToolResult:
    """What a call returned, as text for the model."""

    name: str
    content: str
    ok: bool


def _json_type(annotation: Any) -> dict[str, Any]:
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(annotation) if a is not type(None)]
        return _json_type(options[0]) if len(options) == 1 else {"anyOf": [_json_type(a) for a in options]}
    base = origin or annotation
    if base in _JSON_TYPES:
        return {"type": _JSON_TYPES[base]}
    return {}


def _docstring_parts(doc: str) -> tuple[str, dict[str, str]]:
    """(description, {arg: description}) from a Google-style docstring."""
    doc = inspect.cleandoc(doc or "")
    paragraphs = doc.split("\n\n")
    description = " ".join(paragraphs[0].split()) if paragraphs and paragraphs[0] else ""
    args: dict[str, str] = {}
    in_args, current = False, None
    for line in doc.splitlines():
        if line.strip() in ("Args:", "Arguments:", "Parameters:"):
            in_args = True
            continue
        if in_args:
            if line and not line.startswith(" "):
                break
            m = re.match(r"\s+(\w+)\s*(?:\([^)]*\))?:\s*(.*)", line)
            if m and (current is None or len(line) - len(line.lstrip()) <= 4):
                current = m.group(1)
                args[current] = m.group(2).strip()
            elif current and line.strip():
                args[current] += " " + line.strip()
    return description, args


def tool(fn: Callable[..., Any] | None = None, *, name: str | None = None,
         preflight: Callable[[], None] | None = None) -> Any:
    """Make a `Tool` from a typed function (usable as `@tool` or `@tool(name=..., preflight=...)`)."""
    if fn is None:
        return lambda f: tool(f, name=name, preflight=preflight)
    description, arg_docs = _docstring_parts(fn.__doc__ or "")
    hints = typing.get_type_hints(fn)
    properties: dict[str, Any] = {}
    required = []
    for pname, param in inspect.signature(fn).parameters.items():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise TypeError(f"tool {fn.__name__}: *args/**kwargs cannot be described to a model")
        prop = _json_type(hints.get(pname, Any))
        if pname in arg_docs:
            prop["description"] = arg_docs[pname]
        if param.default is param.empty:
            required.append(pname)
        else:
            prop["default"] = param.default
        properties[pname] = prop
    return Tool(name or fn.__name__, description, {"type": "object", "properties": properties, "required": required}, fn,
                preflight)


def format_tool_call(name: str, arguments: dict[str, Any]) -> str:
    """The text of a call in the tag format (what a demonstration or a scripted agent writes).

    >>> format_tool_call("calculator", {"expression": "2*3"})
    '<tool_call>{"name": "calculator", "arguments": {"expression": "2*3"}}</tool_call>'
    """
    return TOOL_CALL_OPEN + json.dumps({"name": name, "arguments": arguments}) + TOOL_CALL_CLOSE


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Every `<tool_call>...</tool_call>` in `text`, in order; malformed ones carry `error`.

    An opening tag without a closing one counts as a malformed call.

    >>> [c.name for c in parse_tool_calls('a <tool_call>{"name": "f", "arguments": {}}</tool_call>')]
    ['f']
    >>> parse_tool_calls('<tool_call>{"name": f}</tool_call>')[0].error[:19]
    'the call is not JSO'
    """
    calls: list[ToolCall] = []
    end = 0
    for m in _TAG_RE.finditer(text):
        calls.append(_parse_one(m.group(1)))
        end = m.end()
    rest = text[end:]
    if TOOL_CALL_OPEN in rest:
        raw = rest[rest.index(TOOL_CALL_OPEN) + len(TOOL_CALL_OPEN):]
        calls.append(ToolCall(raw=raw, error=f"the call has no closing {TOOL_CALL_CLOSE} tag"))
    return calls


def _parse_one(raw: str) -> ToolCall:
    try:
        obj = json.loads(raw)
    except (ValueError, RecursionError) as e:
        return ToolCall(raw=raw, error=f"the call is not JSON ({e})")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return ToolCall(raw=raw, error='the call must be an object {"name": ..., "arguments": {...}}')
    arguments = obj.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            pass
    if not isinstance(arguments, dict):
        return ToolCall(name=obj["name"], raw=raw, error="'arguments' must be an object")
    return ToolCall(obj["name"], arguments, None, raw)


def _coerce(value: Any, prop: dict[str, Any], pname: str) -> Any:
    kind = prop.get("type")
    if kind == "integer" and isinstance(value, float) and value.is_integer():
        return int(value)
    if kind == "number" and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    expected = {"string": str, "integer": int, "number": float, "boolean": bool, "array": list, "object": dict}.get(kind)
    if expected is not None and (not isinstance(value, expected) or (expected is int and isinstance(value, bool))):
        raise TypeError(f"argument {pname!r} must be {kind}, got {type(value).__name__}")
    return value


def execute_tool_call(call: ToolCall, tools: dict[str, Tool], max_chars: int = 2000) -> ToolResult:
    """Run one call; every failure becomes an `error:` result, never an exception."""
    if call.error is not None:
        return ToolResult(call.name, f"error: {call.error}", False)
    t = tools.get(call.name)
    if t is None:
        return ToolResult(call.name, f"error: unknown tool {call.name!r}; available: {', '.join(sorted(tools))}", False)
    props, required = t.parameters["properties"], t.parameters["required"]
    unknown = [k for k in call.arguments if k not in props]
    missing = [k for k in required if k not in call.arguments]
    if unknown or missing:
        what = "; ".join(filter(None, [unknown and f"unknown argument(s) {unknown}",
                                       missing and f"missing argument(s) {missing}"]))
        return ToolResult(t.name, f"error: {what}", False)
    try:
        kwargs = {k: _coerce(v, props[k], k) for k, v in call.arguments.items()}
        out = t.fn(**kwargs)
    except SandboxUnavailable:
        raise  # the deployment's fault: the model must neither see it nor be scored on it
    except ToolError as e:
        return ToolResult(t.name, f"error: {e}"[:max_chars], False)
    except Exception as e:  # the tool's failure is the model's observation
        return ToolResult(t.name, f"error: {type(e).__name__}: {e}"[:max_chars], False)
    text = out if isinstance(out, str) else json.dumps(out) if isinstance(out, (dict, list)) else str(out)
    if len(text) > max_chars:
        text = text[:max_chars] + "...[truncated]"
    return ToolResult(t.name, text, True)


def tools_prompt(tools: list[Tool]) -> str:
    """A system-prompt paragraph listing the tools and the call format."""
    lines = ["You can call tools. To call one, write",
             TOOL_CALL_OPEN + '{"name": <tool name>, "arguments": {<arguments>}}' + TOOL_CALL_CLOSE,
             "and wait for the result. Tools:"]
    lines += [json.dumps(t.schema()["function"]) for t in tools]
    return "\n".join(lines)


# -- built-in tools ---------------------------------------------------------------------------

_BIN_OPS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}
_UNARY_OPS: dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_CALC_DIGITS = 100
"""Results and operands beyond this many digits are refused (no 9**9**9 memory bombs)."""


def safe_eval_arithmetic(expression: str) -> Fraction:
    """The exact value of an arithmetic expression: numbers, + - * / // % **, parentheses.

    Anything else (names, calls, attributes, strings, comparisons) raises `ValueError`; nothing
    is ever passed to `eval`.

    >>> safe_eval_arithmetic("(1 + 2) * 3 / 4")
    Fraction(9, 4)
    """
    if not isinstance(expression, str) or len(expression) > 500:
        raise ValueError("the expression must be a string of at most 500 characters")
    try:
        tree = ast.parse(expression.strip().replace("^", "**").replace("×", "*"), mode="eval")
    except SyntaxError as e:
        raise ValueError(f"not an arithmetic expression: {e.msg}") from None
    return _eval_node(tree.body)


def _check_size(x: Fraction) -> Fraction:
    if max(abs(x.numerator), x.denominator).bit_length() > MAX_CALC_DIGITS * 3.33:
        raise ValueError(f"the result has more than {MAX_CALC_DIGITS} digits")
    return x


def _eval_node(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        if isinstance(node.value, float) and not math.isfinite(node.value):
            raise ValueError("numbers must be finite")
        return _check_size(Fraction(node.value))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY_OPS:
        return _UNARY_OPS[type(node.op)](_eval_node(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BIN_OPS:
        left, right = _eval_node(node.left), _eval_node(node.right)
        if isinstance(node.op, ast.Pow):
            if right.denominator != 1:
                raise ValueError("only whole-number exponents are supported")
            if abs(right) * max(1, abs(left.numerator).bit_length(), left.denominator.bit_length()) > MAX_CALC_DIGITS * 3.33:
                raise ValueError(f"the result has more than {MAX_CALC_DIGITS} digits")
        if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and right == 0:
            raise ValueError("division by zero")
        return _check_size(Fraction(_BIN_OPS[type(node.op)](left, right)))
    raise ValueError(f"only numbers and + - * / // % ** ( ) are allowed, not {type(node).__name__}")


def format_number(x: Fraction) -> str:
    """An integer as is, otherwise a decimal rounded to 10 significant digits.

    >>> format_number(Fraction(56088)), format_number(Fraction(1, 3))
    ('56088', '0.3333333333')
    """
    if x.denominator == 1:
        return str(x.numerator)
    return f"{float(x):.10g}"


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly.

    Args:
        expression: numbers with + - * / // % ** and parentheses, e.g. "347 * 29".
    """
    return format_number(safe_eval_arithmetic(expression))


def _python_tool_layers() -> tuple[str, ...]:
    """Layers the `python` tool requires: all, unless the deployment declares its code trusted."""
    return () if os.environ.get(TRUSTED_ENV) == "1" else sandbox.LAYERS


@functools.cache
def _sandbox_missing(require: tuple[str, ...]) -> dict[str, str]:
    # One probe per process: a tool env is built per episode, the machine does not change.
    return sandbox.missing_layers(require)


def python_preflight() -> None:
    """Raise `SandboxUnavailable`, naming the missing layers, if the `python` tool cannot run here."""
    if missing := _sandbox_missing(_python_tool_layers()):
        raise SandboxUnavailable(missing)


def python(code: str) -> str:
    """Run a Python program in a sandbox and return what it printed.

    Args:
        code: a complete program; print the values you need.
    """
    result = sandbox.run_python(code, timeout_s=PYTHON_TOOL_TIMEOUT_S, memory_mb=PYTHON_TOOL_MEMORY_MB,
                                require=_python_tool_layers())
    if result.timed_out:
        raise ToolError(f"timed out after {PYTHON_TOOL_TIMEOUT_S} s\n{result.stdout}")
    if result.exit_code != 0:
        raise ToolError(f"exit code {result.exit_code}\n{result.stdout}{result.stderr[-1000:]}")
    return result.stdout


PYTHON_TOOL_TIMEOUT_S = 5.0
"""Wall-clock limit of one `python` tool call."""
PYTHON_TOOL_MEMORY_MB = 256
"""Address-space limit of one `python` tool call."""
TRUSTED_ENV = "TINKER_SANDBOX_TRUSTED"
"""Set to 1 to let the `python` tool run with whatever isolation the machine gives (trusted code only)."""

BUILTIN_TOOLS: dict[str, Tool] = {t.name: t for t in (tool(calculator), tool(python, preflight=python_preflight))}
"""The built-in tools by name."""


def get_tools(names: list[str] | tuple[str, ...]) -> dict[str, Tool]:
    """Built-in tools by name; `ValueError` naming an unknown one."""
    unknown = [n for n in names if n not in BUILTIN_TOOLS]
    if unknown:
        raise ValueError(f"env.kwargs.tools: unknown tool(s) {unknown}; built-in: {', '.join(BUILTIN_TOOLS)}")
    return {n: BUILTIN_TOOLS[n] for n in names}
