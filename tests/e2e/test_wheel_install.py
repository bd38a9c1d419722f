"""ring-pipeline as an installed package, not a checkout: a wheel built from the repository,
installed into a new venv, run from an empty directory. `ring-pipeline init` writes the shipped
recipes there and `ring-pipeline run tiny` runs the packaged tiny recipe to the end. The venv
borrows the suite's third-party packages (a .pth naming their site-packages, whose own .pth
files, the checkout's editable install among them, are not read): ring-pipeline itself comes
only from the wheel."""
from __future__ import annotations

import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.e2e.clone import stranger_env

pytestmark = [pytest.mark.slow]

# the tiny recipe at fewer steps: the claim is that the packaged recipe runs, not what it learns
SHORTER = ["--set", "stages.sft.max_steps=6", "--set", "stages.sft.checkpoint_every=3",
           "--set", "stages.reasoning_rl.steps=2", "--set", "stages.reasoning_rl.checkpoint_every=1",
           "--set", "stages.general_rl.steps=2", "--set", "stages.general_rl.checkpoint_every=1"]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                            "-w", str(out), str(REPO)], capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stdout + build.stderr
    (path,) = out.glob("ring_pipeline-*.whl")
    return path


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> Path:
    """A new venv holding the wheel; returns its bin/ directory."""
    env_dir = tmp_path_factory.mktemp("venv")
    venv.EnvBuilder(with_pip=False).create(env_dir)
    py = env_dir / "bin" / "python"
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    (site / "suite_packages.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    install = subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps",
                              str(wheel)], capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stdout + install.stderr
    return env_dir / "bin"


def test_the_wheel_carries_the_shipped_recipes(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for recipe in ("tiny", "ring1t", "gpu-small", "smollm2-reasoning", "benchmarks"):
        assert f"pipeline/recipes/{recipe}.yaml" in names, recipe
    assert "pipeline/recipes/lm_eval/gsm8k_local.yaml" in names
    assert not any(n.startswith(("tests/", "benchmarks/")) for n in names)


def test_an_installed_wheel_writes_its_recipes_and_runs_tiny_from_an_empty_directory(installed, tmp_path,
                                                                                  embedded_prefect_home):
    empty = tmp_path / "project"
    empty.mkdir()
    env = stranger_env(tmp_path)
    env.pop("PYTHONPATH", None)
    where = subprocess.run([str(installed / "python"), "-c", "import pipeline; print(pipeline.__file__)"],
                           cwd=empty, env=env, capture_output=True, text=True, check=True).stdout
    assert "site-packages" in where and str(REPO) not in where, where  # the wheel's code, not the checkout's

    cli = str(installed / "ring-pipeline")
    init = subprocess.run([cli, "init", "."], cwd=empty, env=env, capture_output=True, text=True, timeout=120)
    assert init.returncode == 0, init.stdout + init.stderr
    assert (empty / "recipes" / "tiny.yaml").read_text() == (REPO / "recipes" / "tiny.yaml").read_text()
    again = subprocess.run([cli, "init", "."], cwd=empty, env=env, capture_output=True, text=True, timeout=120)
    assert again.returncode == 2 and "exist already" in again.stderr  # nothing a user edited is overwritten

    run = subprocess.run([cli, "run", "tiny", *SHORTER,
                          "--set", f"storage.url=file://{tmp_path}/store",
                          "--set", f"tracking.uri=sqlite:///{tmp_path}/mlflow.db",
                          "--set", f"defaults.work_dir={tmp_path}/work"],
                         cwd=empty, env=env, capture_output=True, text=True, timeout=900)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-6000:]
    for stage in ("data", "curate", "base", "sft", "reasoning_rl", "reward_model", "general_rl"):
        assert f"{stage}: ran" in out, (stage, out[-3000:])
    unknown = subprocess.run([cli, "run", "no-such-recipe"], cwd=empty, env={**env, "COLUMNS": "300"},
                             capture_output=True, text=True)
    assert unknown.returncode == 2 and "no such file, nor a shipped recipe" in unknown.stderr, unknown.stderr
