"""The recipes that ship with ring-pipeline: `recipes/` of the repository, installed with the
package as `pipeline/recipes` (a link to it in a checkout, copied into a wheel), so that an
installed ring-pipeline has them without a checkout: `ring-pipeline run tiny` names one, and
`ring-pipeline init DIR` writes them into DIR/recipes/ to be read and edited."""
from __future__ import annotations

import shutil
from importlib.resources import files
from pathlib import Path

SUFFIX = ".yaml"


class ShippedRecipeError(ValueError):
    """A recipe name that names no shipped recipe, or an `init` that would overwrite files."""


def shipped_dir() -> Path:
    return Path(str(files("pipeline") / "recipes"))


def shipped_names() -> list[str]:
    """The shipped recipes' names (YAML mappings; benchmarks.yaml, a list, is data they name)."""
    import yaml

    return sorted(p.stem for p in shipped_dir().glob(f"*{SUFFIX}") if isinstance(yaml.safe_load(p.read_text()), dict))


def locate(recipe: Path) -> Path:
    """The recipe file a command line names: the path as given when it exists, else, for a bare
    name such as `tiny`, the shipped recipe of that name."""
    if recipe.exists() or recipe.parent != Path(".") or recipe.suffix:
        return recipe
    shipped = shipped_dir() / f"{recipe.name}{SUFFIX}"
    if recipe.name not in shipped_names():
        raise ShippedRecipeError(f"recipe {recipe}: no such file, nor a shipped recipe of that name "
                                 f"(shipped: {', '.join(shipped_names())})")
    return shipped


def write_recipes(target: Path, overwrite: bool = False) -> list[Path]:
    """Copy every shipped recipe (with the files they name, e.g. lm_eval/ task files) into
    `target`/recipes/; existing files are left alone unless `overwrite` (ShippedRecipeError
    names them). Returns the files written."""
    source = shipped_dir()
    files_ = sorted(p for p in source.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    dest = target / "recipes"
    clashes = [dest / p.relative_to(source) for p in files_ if (dest / p.relative_to(source)).exists()]
    if clashes and not overwrite:
        raise ShippedRecipeError(f"{len(clashes)} file(s) exist already, e.g. {clashes[0]}: nothing was written "
                                 "(--force overwrites them)")
    written = []
    for p in files_:
        out = dest / p.relative_to(source)
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(p, out)
        written.append(out)
    return written
