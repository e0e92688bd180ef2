"""`calculator`: arithmetic the small model cannot do in its head, evaluated on the AST (never `eval`).

Only numbers, + - * / // % **, unary signs, parentheses and a few math functions/constants are allowed; powers and
factorials are bounded so that an expression like 9**9**9 is refused instead of eating the CPU for hours.
"""

from __future__ import annotations

import ast
import math
import operator
from typing import Any, Callable

from sinkchat.apps.agent.tools.schema import Arg, ToolError, tool

MAX_EXPR_CHARS = 500
MAX_EXPONENT = 10_000
MAX_RESULT_DIGITS = 10_000

_BIN: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_FUNCS: dict[str, Callable[..., Any]] = {
    "sqrt": math.sqrt, "log": math.log, "log10": math.log10, "log2": math.log2, "exp": math.exp,
    "sin": math.sin, "cos": math.cos, "tan": math.tan, "asin": math.asin, "acos": math.acos, "atan": math.atan,
    "abs": abs, "round": round, "floor": math.floor, "ceil": math.ceil, "min": min, "max": max,
    "factorial": math.factorial,
}
_CONSTS = {"pi": math.pi, "e": math.e, "tau": math.tau}

# What the grammar lets the model write here: numbers, operators, parentheses and the names above, at most 60 of
# them; never a first blank, a comma or any other word. Measured (60-task agent soak, bundled model): all 5 of the
# calls that failed in a tool were calculator calls on text that is not arithmetic (", ", "29 + 88, 2 * 2",
# "falcon.savename"). Commas are left out with it: `round(x, 2)` / `min(a, b)` cannot be written, `round(x)` can.
_TOKEN = "|".join([r"[0-9]{1,15}(?:\.[0-9]{0,15})?", r"\.[0-9]{1,15}", r"\*\*", "//", r"[-+*/%^()]",
                   *sorted([*_FUNCS, *_CONSTS], key=len, reverse=True)])
EXPRESSION_PATTERN = rf"^(?:{_TOKEN})(?:{_TOKEN}| ){{0,59}}$"


@tool(args={"expression": Arg(pattern=EXPRESSION_PATTERN)})
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression, e.g. "(3 + 4) * 2 ** 3" or "sqrt(2) * pi".

    Args:
        expression: numbers, + - * / // % ** and parentheses; functions sqrt, log, exp, sin, cos, round, ...
    """
    expr = expression.strip().replace("^", "**").replace("×", "*").replace("÷", "/")
    if not expr:
        raise ToolError("empty expression")
    if len(expr) > MAX_EXPR_CHARS:
        raise ToolError(f"expression longer than {MAX_EXPR_CHARS} characters")
    try:
        tree = ast.parse(expr, mode="eval")
    except SyntaxError as e:
        raise ToolError(f"not an arithmetic expression: {e.msg}") from None
    try:
        value = _eval(tree.body)
    except ZeroDivisionError:
        raise ToolError("division by zero") from None
    except (OverflowError, ValueError) as e:
        raise ToolError(f"math error: {e}") from None
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        value = int(value)
    return str(value)


def _eval(node: ast.AST) -> Any:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.Name) and node.id in _CONSTS:
        return _CONSTS[node.id]
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BIN:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow):
            _check_pow(left, right)
        if isinstance(node.op, ast.Mult) and isinstance(left, int) and isinstance(right, int):
            if _digits(left) + _digits(right) > MAX_RESULT_DIGITS:
                raise ToolError("result too large")
        return _BIN[type(node.op)](left, right)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCS and not node.keywords:
        args = [_eval(a) for a in node.args]
        if node.func.id == "factorial" and (not args or not isinstance(args[0], int) or args[0] > 1000):
            raise ToolError("factorial takes one integer up to 1000")
        return _FUNCS[node.func.id](*args)
    what = type(node).__name__
    if isinstance(node, ast.Name):
        what = f"name {node.id!r}"
    elif isinstance(node, ast.Call):
        what = "this function call"
    raise ToolError(f"not allowed in an expression: {what} (allowed functions: {', '.join(_FUNCS)})")


def _digits(n: int) -> int:
    return max(1, abs(n).bit_length() * 30103 // 100000 + 1)


def _check_pow(base: Any, exp: Any) -> None:
    if isinstance(exp, (int, float)) and abs(exp) > MAX_EXPONENT:
        raise ToolError(f"exponent larger than {MAX_EXPONENT}")
    if isinstance(base, int) and isinstance(exp, int) and exp > 0 and _digits(base) * exp > MAX_RESULT_DIGITS:
        raise ToolError("result too large")
