"""A headless Chromium (Debian's `chromium` package) driven by Playwright for Python, and the
web UIs it opens: Prefect's UI app and MLflow's tracking server, each a process of the test's own
on a loopback port. Nothing downloads a browser: Playwright launches /usr/bin/chromium.

`shown(page, out_dir, what)` turns a failed check or a UI wait that timed out into an
AssertionError naming what the page showed: a screenshot and the page's text, saved under the
test's dir."""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from stages.common.ports import reserved_port

CHROMIUM = Path("/usr/bin/chromium")
# without the background-networking flags Chromium's own connections (updates, sync, ...) are
# refused on machines that allow only loopback, and it stalls on them
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def require_browser() -> None:
    """Skip, naming the missing package, where the browser or Playwright is not installed."""
    if not CHROMIUM.exists():
        pytest.skip(f"Debian package `chromium` is not installed ({CHROMIUM}): apt-get install -y chromium")
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        pytest.skip("Python package `playwright` is not installed: pip install -c constraints-cpu.txt -e '.[dev]'")


@contextlib.contextmanager
def browser_page(profile: Path) -> Iterator:
    """A page of a fresh headless Chromium whose user-data dir is `profile`."""
    from playwright.sync_api import expect, sync_playwright

    # the UIs' pages take seconds to render on 2 busy cores: `expect` waits up to 30 s, not 5
    expect.set_options(timeout=30_000)
    with sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(
            str(profile), executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, headless=True,
            viewport={"width": 1400, "height": 900})
        try:
            page = context.new_page()
            page.set_default_timeout(30_000)
            yield page
        finally:
            context.close()


@contextlib.contextmanager
def shown(page, out_dir: Path, what: str) -> Iterator[None]:
    """Re-raise a failed check or timed-out wait inside as an AssertionError that names a
    screenshot and the page's text, both saved in `out_dir` as `<what>.png` / `<what>.txt`."""
    from playwright.sync_api import Error as PlaywrightError

    try:
        yield
    except (AssertionError, PlaywrightError) as exc:
        shot, text = out_dir / f"{what}.png", out_dir / f"{what}.txt"
        try:
            page.screenshot(path=str(shot), full_page=True)
            text.write_text(f"{page.url}\n\n{page.inner_text('body')}")
        except PlaywrightError as saving:
            text.write_text(f"{page.url}\n\n(could not read the page: {saving})")
        raise AssertionError(f"{what}: {exc}\nscreenshot: {shot}\npage text: {text}") from exc


@contextlib.contextmanager
def web_process(argv: list[str], env: dict[str, str], log: Path, ready_path: str,
                timeout: float = 120) -> Iterator[str]:
    """Start a web server listening on `{port}` (substituted in `argv`) of 127.0.0.1; yields its
    base URL once `ready_path` answers 200. Stopped (its whole process group) on exit."""
    with reserved_port() as port, open(log, "ab") as out:  # held until the process starts listening
        proc = subprocess.Popen([a.replace("{port}", str(port)) for a in argv], env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        yield _Pending(proc, url, ready_path, timeout, log)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


class _Pending:
    """A started web server: `.url()` waits until it answers, so that servers boot while the
    test does other work."""

    def __init__(self, proc, url, ready_path, timeout, log):
        self.proc, self._url, self.ready_path, self.timeout, self.log = proc, url, ready_path, timeout, log
        self._ready = False

    def url(self) -> str:
        deadline = time.monotonic() + self.timeout
        while not self._ready:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.proc.args[:4]} exited {self.proc.returncode}:\n"
                                   f"{self.log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(self._url + self.ready_path, timeout=5) as resp:
                    self._ready = resp.status == 200
            except OSError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{self._url} did not answer in {self.timeout}s: see {self.log}") from None
                time.sleep(0.2)  # a server booting, polled: not a UI wait
        return self._url


def prefect_ui(api_url: str, root: Path) -> tuple[list[str], dict[str, str]]:
    """Prefect's own UI app (prefect.server.api.server.create_ui_app: the static UI and its
    /ui-settings) pointed at the API server `api_url`; its static files copied under `root`."""
    code = ("import sys, uvicorn; from prefect.server.api.server import create_ui_app; "
            "uvicorn.run(create_ui_app(False), host='127.0.0.1', port=int(sys.argv[1]), log_level='error')")
    env = {**os.environ, "PREFECT_UI_ENABLED": "1", "PREFECT_UI_API_URL": api_url,
           "PREFECT_UI_STATIC_DIRECTORY": str(root / "prefect-ui")}
    return [sys.executable, "-c", code, "{port}"], env


def mlflow_ui(tracking_uri: str, root: Path) -> tuple[list[str], dict[str, str]]:
    """`mlflow server` (the MLflow UI) on the run's backend store."""
    return ([sys.executable, "-m", "mlflow", "server", "--backend-store-uri", tracking_uri,
             "--default-artifact-root", str(root / "mlflow-artifacts"), "--host", "127.0.0.1",
             "--port", "{port}", "--workers", "1"], dict(os.environ))
