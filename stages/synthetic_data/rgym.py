"""The `reasoning_gym` generator: RL / evaluation rows from reasoning-gym's procedural task
families, scored by the `reasoning_gym` verifier domain (verifiers/rgym.py) with each
family's own `score_answer`.

    files:
      train.jsonl:
        generator: reasoning_gym
        n: 2000
        seed: 1
        params:
          split: train
          tasks:
            leg_counting: {weight: 2, config: {min_animals: 2, max_animals: 3}}
            basic_arithmetic: {config: {max_terms: 3, max_digits: 2}}

Rows: `{"id", "domain": "reasoning_gym", "task": family, "prompt": question + ANSWER_FORMAT,
"reference": {"family", "answer", "metadata", "config", "partial_credit"}}` (JSON-safe;
what reasoning_rl and eval read). A family's rows are `n * weight / sum(weights)` (largest
remainders); its dataset seed is derived from the file's seed and its name, so adding a
family leaves the others' rows unchanged.

Split (deterministic, a property of the question, not of a seed): the question is
normalised (NFKC, case-folded, whitespace collapsed) and hashed; it is held out when the
hash falls in the first `HELDOUT_PERCENT` of 100 buckets (`generators.split_of`, the split
every generator here uses). So a `train` file and a `heldout` file never share a question,
whatever their seeds, families or configs; within a file, questions are unique. Entries
are drawn at indices 0, 1, 2, ... of the family's dataset until enough fall in the split.

Each row with a reference answer is scored by the verifier before it is written (the
family's answer in `<answer>` tags, after a JSON round trip, through `verifiers.verify`): a
family whose gold answer does not get full marks is an error, not silently bad data.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import random
import unicodedata
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from stages.synthetic_data.generators import Split, split_of
from verifiers import verify
from verifiers.rgym import ANSWER_FORMAT, EXCLUDED_FAMILIES

RESERVED_CONFIG_KEYS = ("size", "seed")  # the generator sets them
MAX_DRAWS_PER_ROW = 50


class FamilySpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    weight: float = Field(1.0, gt=0, description="share of the file's rows")
    config: dict[str, Any] = Field({}, description="the family's config fields (its difficulty knobs)")


def _families() -> dict[str, Any]:
    from reasoning_gym.factory import (
        DATASETS,  # ~1.5 s: imported only by this generator
    )

    return {name: cfg for name, (_, cfg) in DATASETS.items() if name not in EXCLUDED_FAMILIES}


def _check_tasks(tasks: dict[str, FamilySpec]) -> dict[str, FamilySpec]:
    """Every family known, every config key a field of its config, and the config accepted
    by the family (its own validate()), each error naming the family and key."""
    import reasoning_gym

    if not tasks:
        raise ValueError("tasks must name at least one reasoning-gym family")
    known = _families()
    for family, spec in tasks.items():
        if family not in known:
            raise ValueError(f"unknown reasoning-gym family {family!r}; known: {', '.join(sorted(known))}")
        fields = [f.name for f in dataclasses.fields(known[family]) if f.name not in RESERVED_CONFIG_KEYS]
        for key in spec.config:
            if key not in fields:
                why = "is set by the generator (n, seed)" if key in RESERVED_CONFIG_KEYS else "is not one of its fields"
                raise ValueError(f"tasks.{family}.config.{key} {why}; fields of {family}: {', '.join(fields)}")
        try:
            reasoning_gym.create_dataset(family, **spec.config, size=1, seed=0)
        except (AssertionError, TypeError, ValueError) as e:  # its validate() asserts; a bad value type
            raise ValueError(f"tasks.{family}.config rejected by {family}: {type(e).__name__}: {e}") from None
    return tasks


Tasks = Annotated[dict[str, FamilySpec], AfterValidator(_check_tasks)]


def normalise_question(question: str) -> str:
    """What two questions must differ in to count as different: NFKC, case, whitespace."""
    return " ".join(unicodedata.normalize("NFKC", question).casefold().split())


def family_seed(seed: int, family: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{family}".encode()).digest()[:4], "big")


def apportion(n: int, weights: dict[str, float]) -> dict[str, int]:
    """n rows over the families by weight: floors, then the largest remainders (ties by name)."""
    total = sum(weights.values())
    exact = {k: n * w / total for k, w in weights.items()}
    counts = {k: int(v) for k, v in exact.items()}
    for k in sorted(exact, key=lambda k: (counts[k] - exact[k], k))[: n - sum(counts.values())]:
        counts[k] += 1
    return counts


def _family_rows(family: str, spec: FamilySpec, count: int, seed: int, split: str, seen: set[str],
                 partial_credit: bool) -> list[dict]:
    import reasoning_gym

    fseed = family_seed(seed, family)
    limit = MAX_DRAWS_PER_ROW * count + 100
    dataset = reasoning_gym.create_dataset(family, **spec.config, size=limit, seed=fseed)
    rows: list[dict] = []
    idx = 0
    while len(rows) < count:
        if idx >= limit:
            raise ValueError(f"reasoning_gym: {family} gave {len(rows)} distinct {split!r} questions in {limit} "
                             f"draws, {count} wanted: its config allows too few different questions")
        try:
            entry = json.loads(json.dumps(dataset[idx]))  # JSON-safe, as the verifier will see it
        except (TypeError, ValueError) as e:
            raise ValueError(f"reasoning_gym: {family} entry {idx} is not JSON-safe ({e}); "
                             "this family cannot be written as rows") from None
        idx += 1
        key = normalise_question(entry["question"])
        if key in seen or (split != "all" and split_of(key) != split):
            continue
        seen.add(key)
        reference = {"family": family, "answer": entry["answer"], "metadata": entry["metadata"],
                     "config": spec.config, "partial_credit": partial_credit}
        row = {"id": f"reasoning_gym-{family}-{seed}-{idx - 1}", "domain": "reasoning_gym", "task": family,
               "prompt": f"{entry['question'].rstrip()}\n\n{ANSWER_FORMAT}", "reference": reference}
        if entry["answer"] is not None:
            gold = verify(row, f"<think>\n</think>\n<answer>{entry['answer']}</answer>")
            if gold.score < 1.0:
                raise ValueError(f"reasoning_gym: {family}'s own answer to entry {idx - 1}, in the format the "
                                 f"prompt asks for, scores {gold.score} ({gold.reason}); this family cannot be used")
        rows.append(row)
    return rows


def reasoning_gym_rows(n: int, seed: int, tasks: Tasks, split: Split = "all",
                       partial_credit: bool = False) -> list[dict]:
    """`n` rows over `tasks` (family -> weight and config), shuffled with `seed`.
    `partial_credit`: the verifier passes on the family's partial scores (else 0 below full marks)."""
    tasks = {k: FamilySpec.model_validate(v) for k, v in tasks.items()}  # the registry passes dicts
    counts = apportion(n, {family: spec.weight for family, spec in tasks.items()})
    seen: set[str] = set()
    rows = [row for family, spec in tasks.items()
            for row in _family_rows(family, spec, counts[family], seed, split, seen, partial_credit)]
    random.Random(seed).shuffle(rows)
    return rows
