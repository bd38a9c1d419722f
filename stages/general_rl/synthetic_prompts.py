"""Synthetic general-RL prompts for smoke runs (seeded, no downloads):

- `general_prompts(n, seed)`: open chat prompts (Magpie-style): no reference, judged by the
  reward model alone;
- `ifeval_prompts(n, seed, max_constraints)`: a writing task plus 1..max_constraints
  checkable constraints (RLVR-IFEval / AutoIF style), rows for the `ifeval` verifier
  ({"instructions": [...], "scoring": "fraction"}: the share of constraints followed).

Both return RL rows {"id", "domain", "prompt", ("reference")}; the synthetic_data stage can
register them by import path (stages.general_rl.synthetic_prompts:general_prompts / :ifeval_prompts).
"""
from __future__ import annotations

import random

TOPICS = ["the sea", "autumn", "a small town", "bicycles", "tea", "the moon", "rain", "a library",
          "mountains", "friendship", "a garden", "trains", "winter mornings", "the desert", "music",
          "an old clock", "rivers", "bread", "a lighthouse", "snow"]
TASKS = ["Write a short note about {t}.", "Describe {t} in a few sentences.", "Write a tiny poem about {t}.",
         "Explain why people like {t}.", "Give advice to someone who has never seen {t}.",
         "Tell a very short story about {t}."]
KEYWORDS = ["light", "quiet", "warm", "home", "blue", "simple", "slow", "bright"]


def _constraint(rng: random.Random) -> tuple[str, dict]:
    kind = rng.choice(["lowercase", "max_words", "keyword", "no_commas", "end_with", "bullets"])
    if kind == "lowercase":
        return "Use only lowercase letters.", {"type": "lowercase"}
    if kind == "max_words":
        n = rng.choice([10, 20, 30])
        return f"Answer in at most {n} words.", {"type": "word_count", "relation": "at most", "n": n}
    if kind == "keyword":
        k = rng.choice(KEYWORDS)
        return f"Include the word \"{k}\".", {"type": "keywords_include", "keywords": [k]}
    if kind == "no_commas":
        return "Do not use any commas.", {"type": "no_commas"}
    if kind == "end_with":
        p = rng.choice(["That is all.", "The end."])
        return f"End your answer with \"{p}\"", {"type": "end_with", "phrase": p}
    n = rng.choice([2, 3])
    return f"Answer with exactly {n} bullet points starting with \"- \".", {"type": "bullet_count", "n": n}


def general_prompts(n: int, seed: int) -> list[dict]:
    rng = random.Random(f"general/{seed}")
    return [{"id": f"general-{seed}-{i}", "domain": "general",
             "prompt": rng.choice(TASKS).format(t=rng.choice(TOPICS))} for i in range(n)]


def ifeval_prompts(n: int, seed: int, max_constraints: int = 2) -> list[dict]:
    if max_constraints < 1:
        raise ValueError("max_constraints must be >= 1")
    rng = random.Random(f"ifeval/{seed}")
    rows = []
    for i in range(n):
        picked: dict[str, tuple[str, dict]] = {}
        for _ in range(rng.randint(1, max_constraints)):
            text, inst = _constraint(rng)
            picked.setdefault(inst["type"], (text, inst))  # one constraint per type
        task = rng.choice(TASKS).format(t=rng.choice(TOPICS))
        rows.append({"id": f"ifeval-{seed}-{i}", "domain": "ifeval",
                     "prompt": " ".join([task] + [t for t, _ in picked.values()]),
                     "reference": {"instructions": [inst for _, inst in picked.values()], "scoring": "fraction"}})
    return rows
