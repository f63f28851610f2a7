"""Arithmetic on text from the model, with nothing else reachable and every cost bounded.

The expression is parsed first and checked against a whitelist of syntax (numbers, the arithmetic
operators, parentheses, a few names and math functions), then evaluated by simpleeval with
operators that refuse integers too large to compute quickly. Every error is a ``ValueError``
whose message says what to change.
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable
from typing import Any

import simpleeval  # type: ignore[import-untyped]  # the library ships no type information

MAX_LENGTH = 500
MAX_DEPTH = 50
"""Nesting the evaluator (which recurses) can always handle, however deep its caller's stack."""
MAX_INT_BITS = 10_000
"""Integers stay below ~3,000 digits: computing and printing them takes microseconds."""

FUNCTIONS: dict[str, Callable[..., Any]] = {
    "sqrt": math.sqrt,
    "sin": math.sin,
    "cos": math.cos,
    "tan": math.tan,
    "asin": math.asin,
    "acos": math.acos,
    "atan": math.atan,
    "log": math.log,
    "log2": math.log2,
    "log10": math.log10,
    "exp": math.exp,
    "floor": math.floor,
    "ceil": math.ceil,
    "abs": abs,
    "round": round,
    "min": min,
    "max": max,
}
NAMES: dict[str, float] = {"pi": math.pi, "e": math.e}
SUPPORTED = (
    "numbers, + - * / // % **, parentheses, the constants pi and e, and the functions "
    + ", ".join(FUNCTIONS)
)


def _multiply(a: Any, b: Any) -> Any:
    if isinstance(a, int) and isinstance(b, int) and a.bit_length() + b.bit_length() > MAX_INT_BITS:
        raise ValueError(f"the product is too large (limit: integers of {MAX_INT_BITS} bits)")
    return a * b


def _power(a: Any, b: Any) -> Any:
    exact = isinstance(a, int) and isinstance(b, int) and b > 0 and abs(a) > 1
    if exact and b * math.log2(abs(a)) > MAX_INT_BITS:
        raise ValueError(f"the power is too large (limit: integers of {MAX_INT_BITS} bits)")
    return a**b


OPERATORS: dict[type[ast.AST], Callable[..., Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: _multiply,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: _power,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}


def calculate(expression: str) -> str:
    """The value of ``expression`` as Python writes the number (``1024``, ``0.5``, ``4.0``)."""
    if len(expression) > MAX_LENGTH:
        raise ValueError(f"the expression has {len(expression)} characters (at most {MAX_LENGTH})")
    tree = _parse(expression)
    evaluator = simpleeval.SimpleEval(
        operators=OPERATORS, functions=FUNCTIONS, names=NAMES, allowed_attrs={}
    )
    try:
        value = evaluator.eval(expression, previously_parsed=tree)
    except ZeroDivisionError as e:
        raise ValueError("division by zero") from e
    except OverflowError as e:
        raise ValueError(f"the result is too large ({e})") from e
    except ValueError as e:
        if str(e) != "math domain error":
            raise
        raise ValueError(
            "math domain error: a function got an argument outside its domain "
            "(e.g. sqrt or log of a negative number, asin of 2)"
        ) from e
    except RecursionError as e:
        raise ValueError("the expression is nested too deeply") from e
    except (ArithmeticError, TypeError, simpleeval.InvalidExpression) as e:
        raise ValueError(str(e)) from e
    if isinstance(value, bool) or not isinstance(value, int | float):
        # ValueError like every other refusal: the caller reports them all the same way.
        raise ValueError(f"the result {value!r} is not a real number")  # noqa: TRY004
    return repr(value)


def _parse(expression: str) -> ast.expr:
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise ValueError(f"not an expression ({e.msg}); the calculator takes {SUPPORTED}") from e
    pending: list[tuple[ast.AST, int]] = [(tree.body, 1)]
    while pending:
        node, depth = pending.pop()
        if depth > MAX_DEPTH:
            raise ValueError(f"the expression is nested too deeply (at most {MAX_DEPTH} levels)")
        _check(node)
        pending.extend((child, depth + 1) for child in ast.iter_child_nodes(node))
    return tree.body


def _check(node: ast.AST) -> None:
    match node:
        case ast.Constant(value=value) if isinstance(value, bool) or not isinstance(
            value, int | float
        ):
            raise ValueError(f"{value!r} is not a number; the calculator takes {SUPPORTED}")
        case ast.Name(id=name) if name not in NAMES and name not in FUNCTIONS:
            raise ValueError(f"unknown name {name!r}; the calculator takes {SUPPORTED}")
        case ast.Call(func=ast.Name(id=name)) if name not in FUNCTIONS:
            raise ValueError(f"unknown function {name!r}; the calculator takes {SUPPORTED}")
        case ast.Call(func=ast.Name()) | ast.Constant() | ast.Name() | ast.keyword():
            return
        case ast.BinOp(op=op) | ast.UnaryOp(op=op) if type(op) in OPERATORS:
            return
        case ast.operator() | ast.unaryop() | ast.expr_context():
            return
        case _:
            syntax = ast.unparse(node) if isinstance(node, ast.expr) else type(node).__name__
            raise ValueError(f"{syntax!r} is not supported; the calculator takes {SUPPORTED}")
