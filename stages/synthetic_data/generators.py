"""Generators of synthetic data: `GENERATORS[name](n, seed, **params) -> list[dict]`.

Each generator is a plain function; its keyword parameters (beyond `n` and `seed`) are
its difficulty/format knobs and are validated from its signature (`params_model`), so a
recipe with an unknown generator or a bad parameter fails at validation time. Generators
that live elsewhere (the verifiers package) are registered by import path and loaded
only when used. This module imports nothing heavy (it is imported by the config).

Arithmetic tasks share one question format across SFT (`arithmetic_cot`), RL
(`arithmetic_rl`) and preference data (`preference_pairs`), so a model SFT'd on the
first can sometimes solve the second:
    user: "What is 37 + 48?"
    assistant: "<think>\\n...column-by-column work...\\n</think>\\nThe answer is \\\\boxed{85}."
"""
from __future__ import annotations

import hashlib
import importlib
import inspect
import random
import typing
from dataclasses import dataclass, field
from typing import Annotated, Any, Callable, Literal

from pydantic import ConfigDict, Field, ValidationError, create_model

Op = Literal["+", "-", "*"]
Digits = Annotated[int, Field(ge=1, le=12)]


@dataclass(frozen=True)
class Generator:
    name: str
    description: str
    fn: Callable[..., list[dict]] | None = None
    target: str | None = None  # "package.module:function", imported on first use
    # installed distributions whose code draws the rows (beside ours): their versions are part
    # of the stage's identity (the kind's `input_packages`): another release may draw other rows
    packages: tuple[str, ...] = ()
    _cache: dict = field(default_factory=dict, compare=False, repr=False)

    def function(self) -> Callable[..., list[dict]]:
        if self.fn is not None:
            return self.fn
        if "fn" not in self._cache:
            mod, _, attr = (self.target or "").partition(":")
            try:
                self._cache["fn"] = getattr(importlib.import_module(mod), attr)
            except (ImportError, AttributeError) as e:
                raise ValueError(f"generator {self.name!r}: cannot load {self.target} ({e})") from e
        return self._cache["fn"]

    def params_model(self):
        """A strict pydantic model of the generator's parameters, from its signature."""
        if "model" not in self._cache:
            fn = self.function()
            hints = typing.get_type_hints(fn, include_extras=True)
            fields: dict[str, Any] = {}
            for name, p in inspect.signature(fn).parameters.items():
                if name in ("n", "seed") or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                    continue
                ann = hints.get(name, Any)
                fields[name] = (ann, ... if p.default is inspect.Parameter.empty else p.default)
            self._cache["model"] = create_model(
                f"{self.name}_params", __config__=ConfigDict(extra="forbid", strict=False), **fields)
        return self._cache["model"]

    def validate_params(self, params: dict[str, Any]) -> None:
        """Raise ValueError naming each bad parameter (and the known ones)."""
        model = self.params_model()
        try:
            checked = model.model_validate(params)
        except ValidationError as e:
            problems = "; ".join(f"{'.'.join(map(str, err['loc'])) or 'params'}: {err['msg']}"
                                 for err in e.errors())
            known = ", ".join(model.model_fields) or "none"
            raise ValueError(f"{problems} (parameters of {self.name}: {known})") from None
        if self.fn is not None:
            # local generators are cheap: one row checks constraints across parameters
            # (e.g. min_digits <= max_digits) before any stage runs
            self.fn(1, 0, **checked.model_dump())

    def __call__(self, n: int, seed: int, **params: Any) -> list[dict]:
        model = self.params_model().model_validate(params)
        rows = self.function()(n, seed, **model.model_dump())
        if len(rows) != n:
            raise RuntimeError(f"generator {self.name} returned {len(rows)} rows, expected {n}")
        return rows


GENERATORS: dict[str, Generator] = {}


def register(name: str, description: str, target: str | None = None, packages: tuple[str, ...] = ()):
    def deco(fn: Callable[..., list[dict]] | None) -> Callable[..., list[dict]] | None:
        if name in GENERATORS:
            raise ValueError(f"generator {name!r} registered twice")
        GENERATORS[name] = Generator(name=name, description=description, fn=fn, target=target, packages=packages)
        return fn
    return deco


def get_generator(name: str) -> Generator:
    if name not in GENERATORS:
        known = ", ".join(f"{g.name} ({g.description})" for g in GENERATORS.values())
        raise ValueError(f"unknown generator {name!r}; known generators: {known}")
    return GENERATORS[name]


# -- arithmetic ------------------------------------------------------------------------------
# Train / held-out split of the problem space, by construction: a problem belongs to the
# held-out split when the hash of its expression ("37 + 48 - 15") falls in the first
# HELDOUT_PERCENT buckets of 100. The split is a property of the problem, not of a seed or a
# generator, so every generator and seed agree on it: a `train` file and a `heldout` file
# never share a problem, whatever their seeds, sizes or difficulty parameters.
Split = Literal["all", "train", "heldout"]
HELDOUT_PERCENT = 10


def split_of(expression: str) -> str:
    """"heldout" or "train": where the problem written as `expression` belongs."""
    bucket = int.from_bytes(hashlib.sha256(expression.encode()).digest()[:8], "big") % 100
    return "heldout" if bucket < HELDOUT_PERCENT else "train"


def _draw_in_split(n: int, split: str, draw: Callable[[], Any], what: str) -> list:
    """n draws whose `expression` is in `split` (rejection sampling; "all" keeps every draw,
    so its random stream is that of plain sampling)."""
    out: list = []
    attempts = 0
    while len(out) < n:
        attempts += 1
        if attempts > 1000 * n + 1000:
            raise ValueError(f"no {what} of these parameters falls in the {split!r} split "
                             f"(the space is too small); widen the digits or terms")
        task = draw()
        if split == "all" or split_of(task.expression) == split:
            out.append(task)
    return out


@dataclass(frozen=True)
class ArithmeticTask:
    a: int
    op: str
    b: int

    @property
    def expression(self) -> str:
        return f"{self.a} {self.op} {self.b}"

    @property
    def question(self) -> str:
        return f"What is {self.expression}?"

    @property
    def answer(self) -> int:
        return {"+": self.a + self.b, "-": self.a - self.b, "*": self.a * self.b}[self.op]


def _operand(rng: random.Random, min_digits: int, max_digits: int) -> int:
    d = rng.randint(min_digits, max_digits)
    return rng.randint(0 if d == 1 else 10 ** (d - 1), 10 ** d - 1)


def _check_digits(min_digits: int, max_digits: int) -> None:
    if min_digits > max_digits:
        raise ValueError(f"min_digits ({min_digits}) exceeds max_digits ({max_digits})")


def sample_tasks(n: int, seed: int, min_digits: int, max_digits: int, ops: list[str],
                 split: str = "all") -> list[ArithmeticTask]:
    _check_digits(min_digits, max_digits)
    if not ops:
        raise ValueError("ops must name at least one of + - *")
    rng = random.Random(seed)
    return _draw_in_split(n, split, lambda: ArithmeticTask(
        _operand(rng, min_digits, max_digits), rng.choice(ops), _operand(rng, min_digits, max_digits)),
        "arithmetic problem")


def _digits(x: int) -> list[int]:
    """Digits of x >= 0, ones first."""
    return [int(c) for c in reversed(str(x))]


_PLACES = ["ones", "tens", "hundreds", "thousands", "ten-thousands", "hundred-thousands"]


def _place(i: int) -> str:
    return _PLACES[i] if i < len(_PLACES) else f"10^{i}"


def add_steps(a: int, b: int, drop_carry: bool = False) -> tuple[list[str], int]:
    """Column addition of a, b >= 0; with drop_carry the carries are forgotten (a typical
    mistake, used for rejected answers). Returns the lines and the (possibly wrong) sum."""
    da, db = _digits(a), _digits(b)
    lines, out, carry = [], [], 0
    for i in range(max(len(da), len(db))):
        x, y = (da[i] if i < len(da) else 0), (db[i] if i < len(db) else 0)
        s = x + y + carry
        terms = f"{x} + {y}" + (f" + {carry}" if carry else "")
        new_carry = 0 if drop_carry else s // 10
        lines.append(f"{_place(i)}: {terms} = {s}, write {s % 10}, carry {new_carry}")
        out.append(s % 10)
        carry = new_carry
    if carry:
        lines.append(f"the last carry {carry} becomes the leading digit")
        out.append(carry)
    return lines, int("".join(map(str, reversed(out))))


def sub_steps(a: int, b: int) -> tuple[list[str], int]:
    """Column subtraction a - b with borrows, for a >= b >= 0."""
    da, db = _digits(a), _digits(b)
    lines, out, borrow = [], [], 0
    for i in range(len(da)):
        x, y = da[i], (db[i] if i < len(db) else 0)
        x_eff = x - borrow
        if x_eff < y:
            lines.append(f"{_place(i)}: {x}" + (f" - {borrow}" if borrow else "")
                         + f" is less than {y}, borrow: {x_eff + 10} - {y} = {x_eff + 10 - y}, borrow 1")
            out.append(x_eff + 10 - y)
            borrow = 1
        else:
            lines.append(f"{_place(i)}: {x}" + (f" - {borrow}" if borrow else "") + f" - {y} = {x_eff - y}")
            out.append(x_eff - y)
            borrow = 0
    return lines, int("".join(map(str, reversed(out))))


def binary_steps(a: int, op: str, b: int) -> tuple[list[str], int]:
    """The column-by-column work of one operation `a op b` (a, b >= 0) and its result."""
    if op == "+":
        lines, r = add_steps(a, b)
        body = [f"Add {a} and {b} digit by digit, starting from the ones.", *lines]
    elif op == "-":
        if a >= b:
            lines, r = sub_steps(a, b)
            body = [f"Subtract {b} from {a} digit by digit, starting from the ones.", *lines]
        else:
            lines, r = sub_steps(b, a)
            r = -r
            body = [f"{a} is less than {b}, so compute {b} - {a} and make it negative.",
                    f"Subtract {a} from {b} digit by digit, starting from the ones.", *lines,
                    f"{b} - {a} = {-r}, so the result is {r}."]
    else:
        body = [f"Multiply {a} by each digit of {b}, starting from the ones."]
        partials = []
        for i, d in enumerate(_digits(b)):
            p = a * d * 10 ** i
            partials.append(p)
            body.append(f"{a} * {d * 10 ** i} = {p}")
        total = partials[0]
        for p in partials[1:]:
            body.append(f"{total} + {p} = {total + p}")
            total += p
        r = total
    body.append(f"So {a} {op} {b} = {r}.")
    return body, r


def _think_then_answer(body: list[str], answer: int) -> str:
    return "<think>\n" + "\n".join(body) + "\n</think>\n" + f"The answer is \\boxed{{{answer}}}."


def worked_solution(t: ArithmeticTask) -> str:
    """The assistant's Long-CoT answer: <think> column-by-column work </think> boxed answer."""
    body, r = binary_steps(t.a, t.op, t.b)
    assert r == t.answer, (t, r)
    return _think_then_answer(body, r)


@register("arithmetic_cot", "Long-CoT SFT chats: integer + - * with column-by-column reasoning")
def arithmetic_cot(n: int, seed: int, min_digits: Digits = 1, max_digits: Digits = 2,
                   ops: list[Op] = ["+", "-"], split: Split = "all") -> list[dict]:  # noqa: B006 (read-only default)
    tasks = sample_tasks(n, seed, min_digits, max_digits, ops, split)
    return [{"id": f"arithmetic_cot-{seed}-{i}", "domain": "math",
             "messages": [{"role": "user", "content": t.question},
                          {"role": "assistant", "content": worked_solution(t)}]}
            for i, t in enumerate(tasks)]


@register("arithmetic_rl", "RL prompts with verifiable answers, same task format as arithmetic_cot")
def arithmetic_rl(n: int, seed: int, min_digits: Digits = 1, max_digits: Digits = 2,
                  ops: list[Op] = ["+", "-"], split: Split = "all") -> list[dict]:  # noqa: B006
    tasks = sample_tasks(n, seed, min_digits, max_digits, ops, split)
    return [{"id": f"arithmetic_rl-{seed}-{i}", "domain": "math", "prompt": t.question,
             "reference": {"answer": str(t.answer)}} for i, t in enumerate(tasks)]


# -- multi-step arithmetic: a chain of + and - evaluated left to right -------------------------
ChainOp = Literal["+", "-"]
Terms = Annotated[int, Field(ge=2, le=8)]


@dataclass(frozen=True)
class ChainTask:
    operands: tuple[int, ...]
    ops: tuple[str, ...]  # len(operands) - 1

    @property
    def expression(self) -> str:
        parts = [str(self.operands[0])]
        for op, x in zip(self.ops, self.operands[1:]):
            parts += [op, str(x)]
        return " ".join(parts)

    @property
    def question(self) -> str:
        return f"What is {self.expression}?"

    @property
    def answer(self) -> int:
        total = self.operands[0]
        for op, x in zip(self.ops, self.operands[1:]):
            total = total + x if op == "+" else total - x
        return total


def sample_chains(n: int, seed: int, min_terms: int, max_terms: int, min_digits: int, max_digits: int,
                  ops: list[str], split: str) -> list[ChainTask]:
    """Chains whose running total never drops below zero (a "-" that would is drawn as "+"),
    so every step is column work on non-negative numbers."""
    _check_digits(min_digits, max_digits)
    if min_terms > max_terms:
        raise ValueError(f"min_terms ({min_terms}) exceeds max_terms ({max_terms})")
    if not ops:
        raise ValueError("ops must name at least one of + -")
    rng = random.Random(seed)

    def draw() -> ChainTask:
        operands = [_operand(rng, min_digits, max_digits) for _ in range(rng.randint(min_terms, max_terms))]
        chosen, total = [], operands[0]
        for x in operands[1:]:
            op = rng.choice(ops)
            if op == "-" and x > total:
                op = "+"
            total = total + x if op == "+" else total - x
            chosen.append(op)
        return ChainTask(tuple(operands), tuple(chosen))
    return _draw_in_split(n, split, draw, "chain")


Work = Literal["columns", "compact"]


def chain_solution(t: ChainTask, work: str = "columns") -> str:
    """The chain left to right, each operation on the previous result: "columns" works each
    one digit by digit (binary_steps); "compact" writes one line per operation
    ("12 + 7 = 19"), a shorter chain of thought a small model learns from fewer tokens."""
    body: list[str] = []
    total = t.operands[0]
    steps = list(zip(t.ops, t.operands[1:]))
    for k, (op, x) in enumerate(steps, 1):
        lines, total_next = binary_steps(total, op, x)
        if work == "compact":
            body.append(f"{total} {op} {x} = {total_next}")
        else:
            if len(steps) > 1:
                body.append(f"Step {k}: {total} {op} {x}.")
            body += lines
        total = total_next
    assert total == t.answer, (t, total)
    return _think_then_answer(body, total)


@register("chain_cot", "Long-CoT SFT chats: chains of + and - (2..8 terms), worked column by column or compactly")
def chain_cot(n: int, seed: int, min_terms: Terms = 2, max_terms: Terms = 3, min_digits: Digits = 1,
              max_digits: Digits = 2, ops: list[ChainOp] = ["+", "-"],  # noqa: B006
              split: Split = "all", work: Work = "columns") -> list[dict]:
    tasks = sample_chains(n, seed, min_terms, max_terms, min_digits, max_digits, ops, split)
    return [{"id": f"chain_cot-{seed}-{i}", "domain": "math",
             "messages": [{"role": "user", "content": t.question},
                          {"role": "assistant", "content": chain_solution(t, work)}]}
            for i, t in enumerate(tasks)]


@register("chain_rl", "RL / evaluation prompts with verifiable answers, same task format as chain_cot")
def chain_rl(n: int, seed: int, min_terms: Terms = 2, max_terms: Terms = 3, min_digits: Digits = 1,
             max_digits: Digits = 2, ops: list[ChainOp] = ["+", "-"],  # noqa: B006
             split: Split = "all") -> list[dict]:
    tasks = sample_chains(n, seed, min_terms, max_terms, min_digits, max_digits, ops, split)
    return [{"id": f"chain_rl-{seed}-{i}", "domain": "math", "prompt": t.question,
             "reference": {"answer": str(t.answer)}} for i, t in enumerate(tasks)]


def _rejected(t: ArithmeticTask, rng: random.Random, kind: str) -> str:
    r = t.answer
    if kind == "no_think":  # right number, but no reasoning and no boxed answer
        return f"{r}"
    if kind == "unboxed":  # reasoning, final answer not in the required format
        return worked_solution(t).rsplit("\n", 1)[0] + f"\nI think it is about {r}."
    # a wrong answer from a plausible mistake, formatted like a correct one
    wrong = None
    if t.op == "+":
        lines, s = add_steps(t.a, t.b, drop_carry=True)
        if s != r:
            wrong = ("<think>\n" + "\n".join([f"Add {t.a} and {t.b} digit by digit, starting from the ones.",
                                               *lines, f"So {t.a} + {t.b} = {s}."])
                     + f"\n</think>\nThe answer is \\boxed{{{s}}}.")
    if wrong is None:
        off = rng.choice([-10, -2, -1, 1, 2, 10])
        body = worked_solution(t).split("\n</think>\n")[0]
        body = body.rsplit("\n", 1)[0] + f"\nSo {t.a} {t.op} {t.b} = {r + off}."
        wrong = body + f"\n</think>\nThe answer is \\boxed{{{r + off}}}."
    return wrong


@register("preference_pairs", "reward-model pairs: a correct worked answer vs a wrong/badly formatted one")
def preference_pairs(n: int, seed: int, min_digits: Digits = 1, max_digits: Digits = 2,
                     ops: list[Op] = ["+", "-"],  # noqa: B006
                     wrong_fraction: Annotated[float, Field(ge=0, le=1)] = 0.7,
                     split: Split = "all") -> list[dict]:
    """`wrong_fraction` of the rejected answers are wrong; the rest are right but badly
    formatted (no <think> or no boxed answer)."""
    tasks = sample_tasks(n, seed, min_digits, max_digits, ops, split)
    rng = random.Random(seed + 1)
    rows = []
    for i, t in enumerate(tasks):
        kind = "wrong" if rng.random() < wrong_fraction else rng.choice(["no_think", "unboxed"])
        rows.append({"id": f"preference_pairs-{seed}-{i}", "domain": "math", "prompt": t.question,
                     "chosen": worked_solution(t), "rejected": _rejected(t, rng, kind),
                     "rejected_kind": kind, "reference": {"answer": str(t.answer)}})
    return rows


# -- generators of the verifiers package (imported on first use) ----------------------------
register("countdown", "Countdown / 24-game puzzles (verifiers.logic.countdown.generate)",
         target="verifiers.logic.countdown:generate")(None)
register("math_verifiable", "verifiable arithmetic RL prompts (verifiers.math_gen.generate_arithmetic)",
         target="verifiers.math_gen:generate_arithmetic")(None)
register("general_prompts", "open chat prompts (Magpie-style), judged by the reward model",
         target="stages.general_rl.synthetic_prompts:general_prompts")(None)
register("ifeval_prompts", "instruction-following prompts with checkable constraints",
         target="stages.general_rl.synthetic_prompts:ifeval_prompts")(None)
register("reasoning_gym", "reasoning-gym task families (weights, configs, train/heldout split), "
         "scored by each family's own score_answer", target="stages.synthetic_data.rgym:reasoning_gym_rows",
         packages=("reasoning-gym",))(None)
