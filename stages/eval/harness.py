"""lm-evaluation-harness inside the eval stage (the optional `lm-eval` extra:
`pip install 'ring-pipeline[lm-eval]'`).

- `run_task`: an `LmEvalSet` (a task YAML, read with lm-eval's own loader: its `include:`s and
  `!function`s resolve beside it; or an inline task config; optionally over a local data
  file) run against a model directory with lm-eval's `hf` backend; returns the task's
  metrics, `<metric>,<filter>` -> value as lm-eval reports them (e.g. `exact_match,strict-match`).
  Only the task given is indexed (no default tasks, nothing downloaded when its data is local).
- `gsm8k_scorer`: lm-eval's own GSM8K scoring (the filters and metric of the `gsm8k` task
  YAML shipped with lm-eval: strict-match and flexible-extract, exact_match with its
  regexes_to_ignore), applied to responses we generated; the agreement check uses it.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from stages.common.contract import StageError


def require_lm_eval(what: str):
    """The lm_eval module, or a StageError saying how to install it."""
    try:
        import lm_eval
    except ImportError:
        raise StageError(f"{what} needs lm-evaluation-harness, which is not installed: "
                         "pip install 'ring-pipeline[lm-eval]' (or lm_eval==0.4.13)") from None
    return lm_eval


def read_task_yaml(path: Path, where: str) -> dict[str, Any]:
    """A task YAML read the way lm-eval reads its own (its loader): `include:` files relative
    to the YAML merged under it, `!function module.fn` imported from `module.py` beside it (or
    an importable module). Whatever it cannot read is a StageError naming the set and the file."""
    import yaml

    require_lm_eval(where)
    # lm-eval's own loader, what its TaskManager reads task files with (0.4.12+: the floor in pyproject)
    from lm_eval.tasks._yaml_loader import load_yaml

    try:
        return load_yaml(path, resolve_func=True, recursive=True)
    except yaml.YAMLError as e:
        raise StageError(f"{where}: {path} is not a readable task YAML: {e}") from None
    except FileNotFoundError as e:
        raise StageError(f"{where}: {e.filename}, included by the task YAML {path} (an `include:` is relative to "
                         "the YAML's directory), does not exist") from None
    except (ImportError, AttributeError, ValueError, SyntaxError) as e:
        raise StageError(f"{where}: lm-eval cannot read the task YAML {path} (an `include:` or `!function` of it): "
                         f"{type(e).__name__}: {e}") from None


def _task_config(spec, name: str, fetch: Callable[[str], Path]) -> dict[str, Any]:
    if isinstance(spec.lm_eval, dict):
        config = dict(spec.lm_eval)
    else:
        config = read_task_yaml(Path(fetch(spec.lm_eval)), f"sets.{name}.lm_eval = {spec.lm_eval}")
    config.setdefault("task", name)
    if spec.data is not None:
        config.update(dataset_path="json", dataset_kwargs={"data_files": {spec.split: str(fetch(spec.data))}},
                      test_split=spec.split)
        for key in ("dataset_name", "training_split", "validation_split", "fewshot_split"):
            config.pop(key, None)  # the one file is the one split
    if spec.max_new_tokens is not None:
        config["generation_kwargs"] = {**config.get("generation_kwargs", {}), "max_gen_toks": spec.max_new_tokens}
    for key in ("task", "output_type", "doc_to_text"):
        if key not in config:
            raise StageError(f"sets.{name}.lm_eval: the task config has no {key!r} (lm-eval's task YAML schema)")
    return config


def run_task(spec, name: str, model_dir: Path, fetch: Callable[[str], Path], *, device: str, dtype: str,
             seed: int, trust_remote_code: bool) -> dict[str, float]:
    """The task's metrics on the model in `model_dir` (`<metric>,<filter>` -> value). The task
    goes to lm-eval as its config (what a task YAML is read into: the functions of its
    `!function`s included), so nothing but it is indexed."""
    require_lm_eval(f"eval set {name!r} (an lm-eval task)")
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    config = _task_config(spec, name, fetch)
    try:
        out = simple_evaluate(
            model="hf", model_args={"pretrained": str(model_dir), "dtype": dtype,
                                    "trust_remote_code": trust_remote_code},
            tasks=[config], task_manager=TaskManager(include_defaults=False), num_fewshot=spec.num_fewshot,
            batch_size=spec.batch_size, device=device, limit=spec.limit, log_samples=False,
            apply_chat_template=spec.apply_chat_template, random_seed=seed, numpy_random_seed=seed,
            torch_random_seed=seed, fewshot_random_seed=seed)
    except (KeyError, ValueError, FileNotFoundError, TypeError) as e:
        raise StageError(f"eval set {name!r}: lm-eval could not run task {config['task']!r}: "
                         f"{type(e).__name__}: {e}") from None
    metrics = (out or {}).get("results", {}).get(config["task"], {})
    return {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def gsm8k_scorer() -> tuple[Callable[[list[str], list[str]], dict[str, list[tuple[str, float]]]], dict[str, Any]]:
    """lm-eval's GSM8K scoring as its `gsm8k` task defines it: (score, the task config).
    score(responses, gold answers) -> filter name -> per row (the filtered answer, exact_match
    0 / 1); a gold answer is GSM8K's worked solution ("... #### 18") or the number alone."""
    import yaml

    lm_eval = require_lm_eval("lm-eval's GSM8K metric")
    from lm_eval.api.registry import get_metric
    from lm_eval.filters import build_filter_ensemble

    task_yaml = Path(lm_eval.__file__).parent / "tasks" / "gsm8k" / "gsm8k.yaml"
    config = yaml.safe_load(task_yaml.read_text())
    ensembles = [build_filter_ensemble(f["name"], [(c["function"], {k: v for k, v in c.items() if k != "function"})
                                                   for c in f["filter"]]) for f in config["filter_list"]]
    (metric,) = [m for m in config["metric_list"] if m["metric"] == "exact_match"]
    options = {k: v for k, v in metric.items() if k not in ("metric", "aggregation", "higher_is_better")}
    exact_match = get_metric("exact_match")

    def score(responses: list[str], golds: list[str]) -> dict[str, list[tuple[str, float]]]:
        out: dict[str, list[tuple[str, float]]] = {}
        for ensemble in ensembles:
            resps: Any = [[r] for r in responses]
            docs = [{"answer": g} for g in golds]
            for make in ensemble.filters:
                resps = make().apply(resps, docs)
            # after take_first each row is its one filtered response (a list before it)
            filtered = [r if isinstance(r, str) else r[0] for r in resps]
            out[ensemble.name] = [(p, float(exact_match(predictions=[p], references=[g], **options)["exact_match"]))
                                  for p, g in zip(filtered, golds)]
        return out

    return score, config
