"""Screens for answers that a reasoning-gym scorer would execute.

Several families' `score_answer` (reasoning-gym 0.1.25) run the model's answer as code:
`eval(answer)` (string_insertion, spiral_matrix, binary_matrix, n_queens) or
`sympy.parse_expr(answer)` (countdown, puzzle24, simple_integration, intermediate_integration,
polynomial_multiplication), which evaluates Python with the builtins in scope: an answer
`__import__('os').system(...)` runs a shell command in the verifier, `exit()` ends it,
`9**9**9**9` or `N(pi, 10**9)` never return. Those answers are refused before the scorer
sees them (score 0, with the reason); what the screens let through is what the families'
own answers look like:

- eval families: the answer must be a Python literal (`ast.literal_eval`: lists, tuples,
  strings, numbers), one bare word, or not parse as Python at all (plain text, which eval
  rejects and the scorer reads another way);
- sympy families: a Python expression of numbers, names (no `_`), `+ - * / ** ^` and calls
  of known mathematical functions (sin, exp, log, sqrt, ...); an exponent is a number of
  at most 3 digits (or a fraction of two), and a power's base holds no power (no towers).
"""
from __future__ import annotations

import ast

EVAL_FAMILIES = frozenset({"string_insertion", "spiral_matrix", "binary_matrix", "n_queens"})
SYMPY_FAMILIES = frozenset({"countdown", "puzzle24", "simple_integration", "intermediate_integration",
                            "polynomial_multiplication"})
MATH_FUNCTIONS = frozenset({"sin", "cos", "tan", "cot", "sec", "csc", "asin", "acos", "atan", "sinh", "cosh",
                            "tanh", "exp", "log", "ln", "sqrt", "Abs", "abs"})
MAX_EXPONENT = 999
MAX_EXPRESSION_CHARS = 1000  # the families' own answers are under 200; sympy's simplify of more is slow
_ARITH = (ast.Add, ast.Sub, ast.Mult, ast.Div, ast.Pow, ast.BitXor)  # "^" is a power to a reader


def _literal_or_not_python(answer: str) -> str | None:
    try:
        tree = ast.parse(answer.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None  # not Python: eval raises, the scorer reads the text its other way
    if isinstance(tree.body, ast.Name):
        return None  # a bare word ("ABCDE"): eval looks the name up, nothing runs
    try:
        ast.literal_eval(answer)
    except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
        return "the answer is Python code, not a literal (this family's scorer would eval() it)"
    return None


def _small_exponent(node: ast.AST) -> bool:
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        node = node.operand
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
        return _small_exponent(node.left) and _small_exponent(node.right)
    return isinstance(node, ast.Constant) and type(node.value) is int and abs(node.value) <= MAX_EXPONENT


def _has_power(node: ast.AST) -> bool:
    return any(isinstance(n, ast.BinOp) and isinstance(n.op, (ast.Pow, ast.BitXor)) for n in ast.walk(node))


def _math_problem(node: ast.AST) -> str | None:
    """Why `node` is not plain arithmetic on numbers, names and known functions, or None."""
    if isinstance(node, ast.Constant):
        return None if type(node.value) in (int, float) else f"{node.value!r} is not a number"
    if isinstance(node, ast.Name):
        return None if "_" not in node.id else f"name {node.id!r} is not allowed"
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        return _math_problem(node.operand)
    if isinstance(node, ast.BinOp) and isinstance(node.op, _ARITH):
        if isinstance(node.op, (ast.Pow, ast.BitXor)):
            if not _small_exponent(node.right):
                return f"an exponent must be a number of at most {len(str(MAX_EXPONENT))} digits"
            if _has_power(node.left):
                return "a power of a power is not allowed"
        return _math_problem(node.left) or _math_problem(node.right)
    if isinstance(node, ast.Call):
        name = node.func.id if isinstance(node.func, ast.Name) else None
        if name not in MATH_FUNCTIONS or node.keywords:
            return f"{name or 'this'}(...) is not a known math function"
        return next((p for p in map(_math_problem, node.args) if p), None)
    return f"{type(node).__name__} is not arithmetic"


def _sympy_safe(answer: str) -> str | None:
    if len(answer) > MAX_EXPRESSION_CHARS:
        return f"an expression of {len(answer)} chars (at most {MAX_EXPRESSION_CHARS}; the scorer simplifies it)"
    try:
        tree = ast.parse(answer.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return "not a math expression the scorer can read safely (it evaluates the answer)"
    problem = _math_problem(tree.body)
    return f"{problem} (this family's scorer evaluates the answer)" if problem else None


def unsafe_answer(family: str, answer: str) -> str | None:
    """Why `answer` must not reach `family`'s scorer, or None when it may."""
    if family in EVAL_FAMILIES:
        return _literal_or_not_python(answer)
    if family in SYMPY_FAMILIES:
        return _sympy_safe(answer)
    return None
