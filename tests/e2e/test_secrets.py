"""No credential of a recipe is written anywhere (issue 37): a distinct secret in every place
a recipe can take one, a real run of a data stage, a tokenizer stage and a training stage,
then every byte the run wrote is searched for each secret (raw, URL-encoded, base64).

The secrets are real credentials of real servers that refuse anything else: the S3 store
(moto) is given its key and secret through `${env:}`, the MLflow tracking server (in this
process) asks for the password of its URI, and the HTTP server holding the data asks for
the user info of the data URLs; so the run succeeding proves that each one reached the
processes that needed it, through their environment.
"""
from __future__ import annotations

import base64
import functools
import http.server
import json
import os
import stat
import subprocess
import sys
import textwrap
import threading
import urllib.request
import uuid
from urllib.parse import quote, quote_plus

import pytest

from tests import prefect_db
from tests.conftest import REPO

pytestmark = pytest.mark.slow

SECRETS = {  # name -> a value found nowhere else
    "store_key": "AKIA" + uuid.uuid4().hex[:16].upper(),
    "store_secret": "sk-" + uuid.uuid4().hex,
    "tracking_password": "tp-" + uuid.uuid4().hex[:20],
    "data_password": "dp-" + uuid.uuid4().hex[:20],
    "corpus_password": "cp-" + uuid.uuid4().hex[:20],
    "description": "desc-" + uuid.uuid4().hex[:20],
}


def _basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


class _AuthFiles(http.server.SimpleHTTPRequestHandler):
    """Files behind HTTP basic auth (the data URLs' user info)."""

    allowed: set[str] = set()

    def _authorised(self) -> bool:
        if self.headers.get("Authorization") in self.allowed:
            return True
        self.send_response(401)
        self.end_headers()
        return False

    def do_GET(self):
        if self._authorised():
            super().do_GET()

    def do_HEAD(self):
        if self._authorised():
            super().do_HEAD()

    def log_message(self, *args):
        pass


@pytest.fixture
def data_server(tmp_path):
    served = tmp_path / "served"
    served.mkdir()
    rows = [{"messages": [{"role": "user", "content": f"What is {i} + {i + 1}?"},
                          {"role": "assistant", "content": f"<think>{i} plus {i + 1}</think> {2 * i + 1}"}]}
            for i in range(48)]
    (served / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    handler = type("Handler", (_AuthFiles,), {"allowed": {_basic("bob", SECRETS["data_password"]),
                                                          _basic("carol", SECRETS["corpus_password"])}})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(handler, directory=str(served)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.fixture
def mlflow_server(tmp_path):
    """An MLflow tracking server that answers only with the URI's password."""
    from werkzeug.serving import make_server

    names = {"_MLFLOW_SERVER_FILE_STORE": f"sqlite:///{tmp_path}/mlflow-server.db",
             "_MLFLOW_SERVER_ARTIFACT_ROOT": "mlflow-artifacts:/",
             "_MLFLOW_SERVER_ARTIFACT_DESTINATION": str(tmp_path / "mlflow-server-artifacts"),
             "_MLFLOW_SERVER_SERVE_ARTIFACTS": "true"}
    # restored after, MLFLOW_TRACKING_URI too: the server's store lookup sets it in this process
    # (left, it pointed the worker's later tests, and the stage jobs they start, at this test's DB)
    old = {k: os.environ.get(k) for k in [*names, "MLFLOW_TRACKING_URI"]}
    os.environ.update(names)
    from mlflow.server import app

    expected = _basic("alice", SECRETS["tracking_password"])

    def guarded(environ, start_response):
        if environ.get("HTTP_AUTHORIZATION") != expected:
            start_response("401 Unauthorized", [("Content-Type", "text/plain")])
            return [b"unauthorised"]
        return app(environ, start_response)

    server = make_server("127.0.0.1", 0, guarded, threaded=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    # MLflow makes (migrates) its database at the first request, seconds of CPU in this
    # process: done now, so that the run's reachability probe (10 s) meets a ready server
    # even on a loaded machine (CI once saw "unreachable: timed out" there)
    first = urllib.request.Request(f"http://127.0.0.1:{server.server_port}/api/2.0/mlflow/experiments/search"
                                   "?max_results=1", headers={"Authorization": expected})
    urllib.request.urlopen(first, timeout=300).close()
    yield f"127.0.0.1:{server.server_port}"
    server.shutdown()
    for k, v in old.items():
        os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


def _forms(value: str) -> set[bytes]:
    raw = value.encode()
    return {raw, quote(value, safe="").encode(), quote_plus(value).encode(), base64.b64encode(raw).rstrip(b"="),
            base64.urlsafe_b64encode(raw).rstrip(b"=")}


def _leaks(blobs: dict[str, bytes]) -> list[str]:
    return [f"{name}: {where}" for name, value in SECRETS.items() for where, blob in blobs.items()
            if any(f in blob for f in _forms(value))]


def test_no_secret_is_written_anywhere(tmp_path, s3_bucket, data_server, mlflow_server, prefect_template):
    import s3fs

    bucket_url, opts = s3_bucket
    recipe = tmp_path / "secret.yaml"
    recipe.write_text(textwrap.dedent(f"""\
        name: secret
        description: "run ${{env:RING_T_DESC}}"
        storage:
          url: {bucket_url}/runs
          options:
            endpoint_url: {opts["endpoint_url"]}
            key: "${{env:RING_T_KEY}}"
            secret: "${{env:RING_T_SECRET}}"
            client_kwargs: {{region_name: us-east-1}}
        tracking: {{uri: "http://alice:{SECRETS["tracking_password"]}@{mlflow_server}"}}
        defaults: {{launcher: torchrun, resources: {{cpu_ranks: 1}}, work_dir: {tmp_path}/work}}
        stages:
          curate:
            kind: curate
            data: ["http://bob:${{env:RING_T_DATA_PW}}@{data_server}/sft.jsonl"]
            steps: [{{step: exact_dedup}}]
            num_proc: 1
          base:
            kind: init_model
            architecture: {{hidden_size: 32, num_hidden_layers: 1, num_attention_heads: 4,
                            num_key_value_heads: 2, intermediate_size: 64}}
            tokenizer: {{corpus: ["http://carol:{SECRETS["corpus_password"]}@{data_server}/sft.jsonl"],
                         vocab_size: 300}}
          sft:
            kind: sft
            model: ${{stages.base.output}}
            data: ${{stages.curate.output}}/curated.jsonl
            max_seq_len: 128
            max_steps: 2
            warmup_steps: 1
            micro_batch_size: 2
            checkpoint_every: 1
        """))
    prefect_db.seed(tmp_path / "prefect", prefect_template)  # its embedded server's home, searched below
    env = {**os.environ, "RING_T_KEY": SECRETS["store_key"], "RING_T_SECRET": SECRETS["store_secret"],
           "RING_T_DATA_PW": SECRETS["data_password"], "RING_T_DESC": SECRETS["description"],
           "PREFECT_HOME": str(tmp_path / "prefect"), "AWS_ACCESS_KEY_ID": "unused", "AWS_SECRET_ACCESS_KEY": "unused"}
    out = subprocess.run([sys.executable, "-m", "pipeline.cli", "run", str(recipe), "--verbose"], cwd=REPO, env=env,
                         capture_output=True, timeout=600)
    console = out.stdout + out.stderr
    assert out.returncode == 0, console.decode(errors="replace")[-5000:]
    assert b"sft: ran" in console

    blobs = {"console": console}
    for path in tmp_path.rglob("*"):
        if path.is_file() and path != recipe:
            blobs[str(path.relative_to(tmp_path))] = path.read_bytes()
    fs = s3fs.S3FileSystem(**opts)
    fs.invalidate_cache()
    store = fs.find(bucket_url[len("s3://"):])
    assert any("/sft-" in p and p.endswith("/_SUCCESS") for p in store)
    for p in store:
        blobs[f"s3://{p}"] = fs.cat(p)
    assert any("mlflow-server" in k for k in blobs) and any(k.startswith("prefect") for k in blobs)
    leaks = _leaks(blobs)
    assert leaks == [], "\n".join(leaks)

    # what was written instead: references, and the job files readable by their owner only
    resolved = next(b for k, b in blobs.items() if k.endswith("resolved.yaml"))
    assert b"${env:RING_T_SECRET}" in resolved and b"http://***@127.0.0.1" in resolved
    assert b"http://bob:${env:RING_T_DATA_PW}@" in resolved
    jobs = list((tmp_path / "work").rglob("job.json"))
    assert len(jobs) == 3
    for job in jobs:
        assert stat.S_IMODE(job.stat().st_mode) == 0o600
    assert b"${env:RING_T_KEY}" in next(j for j in jobs if "sft-" in str(j)).read_bytes()
