"""Credentials of a recipe: what is registered, how it is written, how a job gets it back."""
from __future__ import annotations

import base64
import json
import os
import stat
import textwrap
import uuid
from urllib.parse import quote

import pytest

from pipeline.loader import RecipeError, load_recipe
from stages.common import secrets
from stages.common.contract import StageError, StageJob


@pytest.fixture(autouse=True)
def _registry_restored():
    """Each test's credentials leave the process's registry with it: a later test in this
    worker must not find its job files rewritten to reference them."""
    saved = dict(secrets._secrets), list(secrets._order)
    yield
    secrets._secrets.clear()
    secrets._secrets.update(saved[0])
    secrets._order[:] = saved[1]


def _secret(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:16]}"


def _recipe(tmp_path, body: str):
    path = tmp_path / "r.yaml"
    path.write_text(textwrap.dedent(body))
    return path


def test_each_way_in_is_registered_and_written_redacted(tmp_path, monkeypatch):
    env_secret, literal, url_pw, token = _secret("env"), _secret("lit"), _secret("pw"), _secret("tok")
    monkeypatch.setenv("T_SECRET", env_secret)
    recipe = load_recipe(_recipe(tmp_path, f"""\
        name: t
        storage: {{url: "file://{tmp_path}/s", options: {{secret: "${{env:T_SECRET}}", password: {literal},
                   client_kwargs: {{aws_session_token: {token}}}}}}}
        tracking: {{uri: "postgresql://mlflow:{url_pw}@db:5432/mlflow"}}
        stages:
          data: {{kind: synthetic_data, files: {{a.jsonl: {{generator: arithmetic_cot, n: 4}}}}}}
        """))
    dumped = recipe.model_dump(mode="json")
    public = json.dumps(secrets.public(dumped))
    for value in (env_secret, literal, url_pw, token):
        assert value not in public
    assert '"${env:T_SECRET}"' in public and "postgresql://***@db:5432" in public
    # every encoded form a client or a log may use
    for form in (quote(url_pw, safe=""), base64.b64encode(f"mlflow:{url_pw}".encode()).decode().rstrip("="),
                 json.dumps(literal)[1:-1]):
        assert form not in secrets.redact(f"header {form} end")


def test_job_file_holds_references_and_the_job_resolves_them(tmp_path, monkeypatch):
    value, literal = _secret("k"), _secret("lit")
    monkeypatch.setenv("T_KEY", value)
    secrets.remember_env("T_KEY", value)
    secrets.remember_credential(literal)
    job = StageJob(recipe="r", stage="s", kind="sft", hash="0" * 16, config={"data": f"s3://b/{value}/x"},
                   stage_url="file:///x", storage_options={"key": value, "secret": literal},
                   output_dir=str(tmp_path / "o"), work_dir=str(tmp_path / "w"))
    path = tmp_path / "job.json"
    path.write_text("old")
    os.chmod(path, 0o644)  # an existing file is made private too
    text = job.write(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert value not in path.read_text() and literal not in path.read_text()
    env = secrets.job_env(text)
    assert env["T_KEY"] == value and literal in env.values()
    for name, v in env.items():
        monkeypatch.setenv(name, v)
    back = StageJob.read(path)
    assert back.storage_options == {"key": value, "secret": literal}
    assert back.config["data"] == f"s3://b/{value}/x"
    monkeypatch.delenv("T_KEY")
    with pytest.raises(StageError, match=r"\$\{env:T_KEY\}.*not set"):
        StageJob.read(path)


def test_a_credential_on_the_command_line_is_refused(tmp_path, monkeypatch):
    path = _recipe(tmp_path, """\
        name: t
        stages:
          data: {kind: synthetic_data, files: {a.jsonl: {generator: arithmetic_cot, n: 4}}}
        """)
    value = _secret("cli")
    for assignment in (f"storage.options.secret={value}", f"storage.options={{key: {value}}}",
                       f"tracking.uri=http://u:{value}@h:5000"):
        with pytest.raises(RecipeError) as e:
            load_recipe(path, [assignment])
        assert value not in str(e.value) and "environment variable" in str(e.value)
    from_env = _secret("env")
    monkeypatch.setenv("T_CLI", from_env)
    recipe = load_recipe(path, ["storage.options.secret=${env:T_CLI}"])
    assert recipe.storage.options["secret"] == from_env
    assert secrets.public(recipe.storage.options) == {"secret": "${env:T_CLI}"}


def test_a_recipe_error_never_quotes_a_credential(tmp_path, monkeypatch):
    value = _secret("bad")
    monkeypatch.setenv("T_BAD", value)
    path = _recipe(tmp_path, """\
        name: t
        storage: {keep_checkpoints: "${env:T_BAD}"}
        stages:
          data: {kind: synthetic_data, files: {a.jsonl: {generator: arithmetic_cot, n: 4}}}
        """)
    with pytest.raises(RecipeError) as e:
        load_recipe(path)
    assert "storage.keep_checkpoints" in str(e.value) and value not in str(e.value)
    assert "${env:T_BAD}" in str(e.value)


def test_short_or_common_values_do_not_garble_text():
    secrets.remember_env("T_STEPS", "5")  # a value from the environment, but no credential by its look
    assert secrets.redact("step 5 of 50") == "step 5 of 50"
    assert secrets.public({"n": "5"}) == {"n": "${env:T_STEPS}"}  # a whole value is still its reference


def test_a_remote_node_gets_the_job_credentials_on_stdin_not_argv(monkeypatch):
    from pipeline.torchrun_hosts import Host, node_command

    value = _secret("node")
    monkeypatch.setenv("T_NODE_KEY", value)
    monkeypatch.setenv("RING_FORWARD_ENV", "T_NODE_KEY")
    command, script = node_command(Host("gpu-node-7", 8, 2), 1, 2, 8, "gpu-node-1", 29500, ["-m", "stages.sft.job"])
    assert command[:4] == ["ssh", "-o", "BatchMode=yes", "gpu-node-7"] and value not in " ".join(command)
    assert f"export T_NODE_KEY={value}" in script and script.rstrip().splitlines()[-1].startswith("exec ")
    local, none = node_command(Host("localhost", 8, 1), 0, 2, 8, "127.0.0.1", 29500, ["-m", "stages.sft.job"])
    assert none is None and value not in " ".join(local)


def test_a_short_credential_from_the_environment_is_still_redacted_in_text(tmp_path, monkeypatch):
    monkeypatch.setenv("T_SHORT", "q7Z")
    load_recipe(_recipe(tmp_path, """\
        name: t
        storage: {options: {password: "${env:T_SHORT}"}}
        stages:
          data: {kind: synthetic_data, files: {a.jsonl: {generator: arithmetic_cot, n: 4}}}
        """))
    assert secrets.redact("login with q7Z failed") == "login with ${env:T_SHORT} failed"
