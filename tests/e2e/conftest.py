"""End-to-end fixtures: this process's flows and Prefect clients on the run's shared Prefect
server (tests/conftest.py's `prefect_api`), as prefect_test_harness would put them on one of
their own."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def prefect_harness(prefect_api):
    from prefect.context import _temporary_global_settings_context, get_settings_context
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: prefect_api}):
        # also the process-wide settings, for contexts copied before this one (as the harness does)
        with _temporary_global_settings_context(get_settings_context()):
            yield
