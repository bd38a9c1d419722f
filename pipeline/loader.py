"""YAML -> Recipe: `extends`, `${env:VAR}` interpolation, `--set` overrides.

Every error names where the bad value came from: `file:line: key.path: problem`
(or `--set key=value: ...` for an override).
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from pipeline.endpoints import probe_store, probe_tracking
from pipeline.recipe import Recipe, RecipeGraphError
from stages.common import secrets
from stages.common.secrets import CREDENTIAL_KEY

_ENV_RE = re.compile(r"\$\{env:([A-Za-z_][A-Za-z0-9_]*)(?::-(.*?))?\}")
Path_ = tuple  # a key path inside the recipe, e.g. ("stages", "sft", "lr")


class RecipeError(Exception):
    """A recipe that cannot be used; the message lists every problem with its location."""

    def __init__(self, problems: list[str]):
        problems = [secrets.redact(p) for p in problems]  # a bad value is quoted back: never a credential
        self.problems = problems
        super().__init__("\n".join(problems))


@dataclass
class Origin:
    file: str
    line: int | None  # 1-based

    def __str__(self) -> str:
        return f"{self.file}:{self.line}" if self.line else self.file


class _Loader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate keys (a silent override is a classic recipe bug)."""


_SCALARS = _Loader("")  # constructs scalar values (ints, floats, bools, null) from nodes


def _compose(path: Path) -> yaml.Node | None:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise RecipeError([f"{path}: recipe file not found"]) from None
    except (UnicodeDecodeError, IsADirectoryError) as e:
        raise RecipeError([f"{path}: cannot read recipe: {e}"]) from None
    try:
        return yaml.compose(text, Loader=_Loader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        raise RecipeError([f"{where}: invalid YAML: {getattr(e, 'problem', e)}"]) from None


def _to_python(node: yaml.Node, file: str, key: Path_, origins: dict[Path_, Origin],
               problems: list[str]) -> Any:
    """Node tree -> plain data, recording the line of every key path."""
    origins[key] = Origin(file, node.start_mark.line + 1)
    if isinstance(node, yaml.MappingNode):
        out: dict[str, Any] = {}
        for k_node, v_node in node.value:
            k = k_node.value
            if k in out:
                problems.append(f"{file}:{k_node.start_mark.line + 1}: {_dotted((*key, k))}: "
                                "duplicate key")
            out[k] = _to_python(v_node, file, (*key, k), origins, problems)
        return out
    if isinstance(node, yaml.SequenceNode):
        return [_to_python(v, file, (*key, i), origins, problems) for i, v in enumerate(node.value)]
    value = node.value if node.tag == "tag:yaml.org,2002:str" else _SCALARS.construct_object(node, deep=True)
    if isinstance(value, str):
        value = _interpolate_env(value, f"{file}:{node.start_mark.line + 1}: {_dotted(key)}", problems)
    return value


def _interpolate_env(value: str, where: str, problems: list[str]) -> str:
    def sub(m: re.Match) -> str:
        var, default = m.group(1), m.group(2)
        if var in os.environ:
            secrets.remember_env(var, os.environ[var])  # kept out of everything written (stages.common.secrets)
            return os.environ[var]
        if default is not None:
            return default
        problems.append(f"{where}: environment variable {var} is not set "
                        f"(write ${{env:{var}:-default}} for a default)")
        return m.group(0)

    return _ENV_RE.sub(sub, value)


def _dotted(key: Path_) -> str:
    """A key path as `--set` accepts it: keys that contain a dot are quoted."""
    return ".".join(f'"{k}"' if isinstance(k, str) and "." in k else str(k) for k in key) or "<root>"


def split_key_path(dotted: str) -> list[str]:
    """`a."b.c".d` -> ["a", "b.c", "d"]: quotes ("..." or '...') keep dots inside a key."""
    keys, current, quote, quoted = [], "", None, False
    for ch in dotted.strip():
        if quote:
            if ch == quote:
                quote = None
            else:
                current += ch
        elif ch in "\"'" and not current:
            quote, quoted = ch, True
        elif ch == ".":
            keys.append(current)
            current, quoted = "", False
        elif quoted:
            raise ValueError(f"text after the closing quote of {current!r}")
        else:
            current += ch
    if quote:
        raise ValueError(f"unclosed {quote} quote")
    keys.append(current)
    if not all(keys):
        raise ValueError("empty key")
    return keys


def _merge(base: Any, child: Any) -> Any:
    """Deep merge: mappings merge key by key (order: base first); anything else replaces."""
    if isinstance(base, dict) and isinstance(child, dict):
        out = dict(base)
        for k, v in child.items():
            out[k] = _merge(base[k], v) if k in base else v
        return out
    return child


def _load_file(path: Path, origins: dict[Path_, Origin], seen: tuple[Path, ...]) -> dict[str, Any]:
    path = path.resolve()
    if path in seen:
        raise RecipeError([f"{path}: `extends` loops: " + " -> ".join(str(p) for p in (*seen, path))])
    node = _compose(path)
    problems: list[str] = []
    file_origins: dict[Path_, Origin] = {}
    data = _to_python(node, str(_display(path)), (), file_origins, problems) if node else {}
    if problems:
        raise RecipeError(problems)
    if not isinstance(data, dict):
        raise RecipeError([f"{_display(path)}:1: a recipe is a mapping (name, storage, stages, ...)"])
    base_ref = data.pop("extends", None)
    if base_ref is not None:
        if not isinstance(base_ref, str):
            raise RecipeError([f"{file_origins[('extends',)]}: extends: expected a file path"])
        base_path = (path.parent / base_ref)
        if not base_path.exists():
            raise RecipeError([f"{file_origins[('extends',)]}: extends: {base_ref} not found "
                               f"(looked at {base_path})"])
        base = _load_file(base_path, origins, (*seen, path))
        data = _merge(base, data)
    origins.update({k: v for k, v in file_origins.items() if k != ("extends",)})
    return data


def _display(path: Path) -> Path:
    try:
        return path.relative_to(Path.cwd())
    except ValueError:
        return path


def _split_assignment(assignment: str) -> tuple[str, str] | None:
    """KEY.PATH=VALUE at the first `=` outside quotes (a quoted key may contain `=`)."""
    quote = None
    for i, ch in enumerate(assignment):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "\"'":
            quote = ch
        elif ch == "=":
            return assignment[:i], assignment[i + 1:]
    if quote:
        raise ValueError(f"unclosed {quote} quote")
    return None


def apply_override(data: dict[str, Any], assignment: str, origins: dict[Path_, Origin]) -> None:
    """`a.b.c=value`: the value is parsed as YAML (so `3`, `1.0e-4`, `[a, b]`, `true` work)."""
    try:
        parts = _split_assignment(assignment)
    except ValueError as e:
        raise RecipeError([f"--set {assignment}: {e} (quote a key that contains dots: a.\"b.c\".d=VALUE)"]) from None
    if parts is None:
        raise RecipeError([f"--set {assignment}: expected KEY.PATH=VALUE"])
    dotted, raw = parts
    try:
        keys = split_key_path(dotted)
    except ValueError as e:
        raise RecipeError([f"--set {assignment}: {e} in {dotted!r} (quote a key that contains dots: "
                           'a."b.c".d=VALUE)']) from None
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as e:
        raise RecipeError([f"--set {assignment}: value is not valid YAML: {e}"]) from None
    value = _override_value(value, keys[-1], assignment)
    node: Any = data
    for i, k in enumerate(keys[:-1]):
        nxt = node.get(k) if isinstance(node, dict) else None
        if nxt is None:
            nxt = node[k] = {}
        if not isinstance(nxt, dict):
            raise RecipeError([f"--set {assignment}: {_dotted(tuple(keys[:i + 1]))} is not a mapping"])
        node = nxt
    node[keys[-1]] = value
    origin = Origin(f"--set {assignment}", None)
    prefix = tuple(keys)
    for k in [k for k in origins if k[:len(prefix)] == prefix]:
        del origins[k]
    origins[prefix] = origin


def _override_value(value: Any, key: str, assignment: str) -> Any:
    """A `--set` value with `${env:VAR}` substituted. A credential written out is refused: the
    command line lands in the Prefect flow run's parameters and the shell's history."""
    problems: list[str] = []
    literal = [t for t in _leaf_strings(value, key) if (CREDENTIAL_KEY.match(t[0]) and not
                                                      secrets.is_reference_only(t[1])) or secrets.url_credentials(t[1])]
    if literal:
        secrets.remember_credential(literal[0][1])
        raise RecipeError([f"--set {assignment}: a credential on the command line is kept in the Prefect flow "
                           f"run's parameters and the shell's history: put it in an environment variable and "
                           f"write --set '{assignment.split('=', 1)[0]}=${{env:NAME}}'"])
    value = _map_strings(value, lambda s: _interpolate_env(s, f"--set {assignment}", problems))
    if problems:
        raise RecipeError(problems)
    return value


def _leaf_strings(value: Any, key: str) -> list[tuple[str, str]]:
    """(key name, string) of every string inside a --set value."""
    if isinstance(value, dict):
        return [t for k, v in value.items() for t in _leaf_strings(v, str(k))]
    if isinstance(value, list):
        return [t for v in value for t in _leaf_strings(v, key)]
    return [(key, value)] if isinstance(value, str) else []


def _map_strings(value: Any, fn) -> Any:
    if isinstance(value, dict):
        return {k: _map_strings(v, fn) for k, v in value.items()}
    if isinstance(value, list):
        return [_map_strings(v, fn) for v in value]
    return fn(value) if isinstance(value, str) else value


def load_recipe(path: str | os.PathLike, overrides: list[str] = ()) -> Recipe:
    origins: dict[Path_, Origin] = {}
    data = _load_file(Path(path), origins, ())
    for assignment in overrides:
        apply_override(data, assignment, origins)
    secrets.scan(data)
    recipe = validate_data(data, origins, str(_display(Path(path).resolve())))
    recipe._origins = {**origins, (): Origin(str(_display(Path(path).resolve())), None)}
    return recipe


def locate(recipe: Recipe, key: Path_) -> str:
    """`file:line` of a key path of a loaded recipe (its closest written parent's)."""
    origins = recipe._origins
    return _locate(key, origins, str(origins.get((), "recipe")))


def check_endpoints(recipe: Recipe) -> None:
    """RecipeError (`file:line: key: problem`) when the store or the tracking server cannot be
    used now: unreachable, no credentials, credentials refused, no bucket (pipeline.endpoints)."""
    problems = []
    for key, probe in ((("storage", "url"), lambda: probe_store(recipe.storage.url, recipe.storage.options)),
                       (("tracking", "uri"), lambda: probe_tracking(recipe.tracking.uri))):
        try:
            problem = probe()
        except Exception as e:  # noqa: BLE001 - a probe's own failure is still the URL's problem
            problem = f"cannot be checked: {type(e).__name__}: {e}"
        if problem:
            problems.append(f"{locate(recipe, key)}: {'.'.join(key)}: {problem}")
    if problems:
        raise RecipeError(problems)


def _locate(loc: Path_, origins: dict[Path_, Origin], fallback: str) -> str:
    """The closest recorded origin of a key path (the key itself, else its parent...)."""
    for n in range(len(loc), -1, -1):
        if loc[:n] in origins:
            return str(origins[loc[:n]])
    return fallback


def _clean_loc(loc: tuple, data: dict[str, Any]) -> tuple:
    """Drop pydantic's union-tag segments (e.g. 'sft' after a stage name) from a loc."""
    out: list[Any] = []
    node: Any = data
    for part in loc:
        if isinstance(node, dict) and part in node:
            out.append(part)
            node = node[part]
        elif isinstance(node, list) and isinstance(part, int) and part < len(node):
            out.append(part)
            node = node[part]
        elif isinstance(node, dict) and isinstance(part, str) and part.startswith("function-"):
            continue
        elif isinstance(node, dict) and part == node.get("kind"):
            continue  # the discriminator tag pydantic inserts
        else:
            out.append(part)
            node = None
    return tuple(out)


def validate_data(data: dict[str, Any], origins: dict[Path_, Origin], file: str) -> Recipe:
    try:
        return Recipe.model_validate(data)
    except ValidationError as e:
        problems = []
        for err in e.errors(include_url=False):
            loc = _clean_loc(tuple(err["loc"]), data)
            ctx_err = (err.get("ctx") or {}).get("error")
            if isinstance(ctx_err, RecipeGraphError):
                loc = ctx_err.path
                msg = str(ctx_err)
            else:
                msg = err["msg"]
                if err["type"] == "extra_forbidden":
                    msg = "unknown key (not part of this section's schema)"
                elif "input" in err and not isinstance(err["input"], (dict, list)) \
                        and err["type"] != "missing":
                    msg += f" (got {err['input']!r})"
            problems.append(f"{_locate(loc, origins, file)}: {_dotted(loc)}: {msg}")
        raise RecipeError(problems) from None
