"""The store's and the tracking server's URLs are checked by `validate` and before `run`:
an unknown protocol, missing credentials, an unreachable endpoint, a missing bucket are recipe
errors with `file:line` and exit 2, against a real S3 API (moto) and real HTTP servers."""
from __future__ import annotations

import http.server
import json
import textwrap
import threading

import pytest
from typer.testing import CliRunner

from pipeline.cli import app

runner = CliRunner()
STAGES = """\
stages:
  data: {kind: synthetic_data, files: {a.jsonl: {generator: arithmetic_cot, n: 4}}}
"""


def _recipe(tmp_path, storage: str, tracking: str | None = None):
    path = tmp_path / "r.yaml"
    path.write_text(f"name: t\n{storage}\ntracking: {{uri: \"{tracking or f'sqlite:///{tmp_path}/m.db'}\"}}\n"
                    + STAGES)
    return path


def _invoke(*args):
    res = runner.invoke(app, list(args))
    assert res.exception is None or isinstance(res.exception, SystemExit), res.output  # no traceback
    return res


@pytest.mark.parametrize("url, fragment", [
    ("s4://bucket/x", "unknown storage protocol 's4'"),
    ("nosuchfs://b/x", "unknown storage protocol 'nosuchfs'"),
    ("s3:///x", "s3:///x names no bucket"),
])
def test_an_unknown_store_protocol_is_a_recipe_error(tmp_path, url, fragment):
    path = _recipe(tmp_path, f"storage: {{url: {url}}}")
    for command in (["validate", str(path), "--offline"], ["run", str(path)], ["plan", str(path)]):
        res = _invoke(*command)
        assert res.exit_code == 2 and f"r.yaml:2: storage.url: Value error, {fragment}" in res.output, res.output


def test_an_unknown_tracking_scheme_is_a_recipe_error(tmp_path):
    for uri, fragment in (("mlfow://host:5000", "unknown tracking URI scheme 'mlfow'"),
                          ("sqlite://relative.db", "sqlite:///relative/path.db"),
                          ("http://host:port5000", "is not a valid URL"), ("http:///api", "names no host")):
        res = _invoke("validate", str(_recipe(tmp_path, "", uri)), "--offline")
        assert res.exit_code == 2 and "r.yaml:3: tracking.uri:" in res.output and fragment in res.output, res.output


def test_s3_store_problems_name_the_url_and_the_line(tmp_path, s3_bucket, no_aws_credentials, unreachable_port):
    bucket_url, opts = s3_bucket
    endpoint, region = opts["endpoint_url"], json.dumps(opts["client_kwargs"])
    secret = "sk-the-store-secret-0123456789"
    cases = [  # (storage section, what the error says)
        (f"storage: {{url: {bucket_url}/x, options: {{endpoint_url: {endpoint}, client_kwargs: {region}}}}}",
         "no credentials for the store"),
        (f"storage: {{url: {bucket_url}/x, options: {{endpoint_url: 'http://127.0.0.1:{unreachable_port}', key: k, "
         f"secret: {secret}, client_kwargs: {region}}}}}", "is unreachable"),
        (f"storage: {{url: {bucket_url}-missing/x, options: {{endpoint_url: {endpoint}, key: k, secret: {secret}, "
         f"client_kwargs: {region}}}}}", "does not exist: create it first"),
    ]
    for storage, fragment in cases:
        res = _invoke("validate", str(_recipe(tmp_path, storage)))
        assert res.exit_code == 2, res.output
        assert "r.yaml:2: storage.url:" in res.output and fragment in res.output, res.output
        assert secret not in res.output
    # the same store with its credentials: fine (a root that does not exist yet is created by the run)
    good = (f"storage: {{url: {bucket_url}/x, options: {{endpoint_url: {endpoint}, key: k, secret: {secret}, "
            f"client_kwargs: {region}}}}}")
    res = _invoke("validate", str(_recipe(tmp_path, good)))
    assert res.exit_code == 0, res.output


def test_run_refuses_an_unreachable_store_before_starting_anything(tmp_path, no_aws_credentials, unreachable_port):
    storage = f"storage: {{url: s3://b/x, options: {{endpoint_url: 'http://127.0.0.1:{unreachable_port}', key: k, secret: s}}}}"
    path = _recipe(tmp_path, storage)
    path.write_text(path.read_text() + textwrap.dedent(f"""\
        defaults: {{work_dir: {tmp_path}/work}}
        """))
    res = _invoke("run", str(path))
    assert res.exit_code == 2 and "storage.url: the store s3://b/x is unreachable" in res.output, res.output
    assert not (tmp_path / "work").exists()


class _Answer(http.server.BaseHTTPRequestHandler):
    status = 200

    def do_GET(self):
        seen.append(self.headers.get("Authorization"))
        self.send_response(self.status)
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args):
        pass


seen: list = []


@pytest.fixture
def tracking_server():
    servers = []

    def start(status: int) -> str:
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), type("A", (_Answer,), {"status": status}))
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"127.0.0.1:{server.server_address[1]}"

    yield start
    for s in servers:
        s.shutdown()


def test_tracking_server_problems_name_the_uri_and_the_line(tmp_path, tracking_server, unreachable_port):
    storage = f"storage: {{url: 'file://{tmp_path}/store'}}"
    refusing = tracking_server(401)
    cases = [
        (f"http://127.0.0.1:{unreachable_port}", "is unreachable"),
        (f"http://{refusing}", "its credentials are missing"),
        (f"http://alice:tr-password-0123@{refusing}", "its credentials were refused"),
        (f"http://{tracking_server(404)}", "is it an MLflow tracking server"),
    ]
    for uri, fragment in cases:
        res = _invoke("validate", str(_recipe(tmp_path, storage, uri)))
        assert res.exit_code == 2 and "r.yaml:3: tracking.uri:" in res.output and fragment in res.output, res.output
        assert "tr-password-0123" not in res.output
    assert seen[-2].startswith("Basic ")  # the URI's user info was sent as basic auth
    res = _invoke("validate", str(_recipe(tmp_path, storage, f"http://{tracking_server(200)}")))
    assert res.exit_code == 0, res.output


def test_a_local_store_that_cannot_be_written_is_a_recipe_error(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    res = _invoke("validate", str(_recipe(tmp_path, f"storage: {{url: 'file://{blocker}/store'}}")))
    assert res.exit_code == 2 and "is a file, not a directory" in res.output, res.output
