"""The step cache: one directory per (step, hash), trusted only once it holds `_DONE`.

    {cache}/steps/00-read-{hash12}/            rows as parquet parts + quarantine/, _DONE
    {cache}/steps/01-quality-{hash12}/         kept/ + removed/ parts, report.json, _DONE

`_DONE` holds the step's part list and counts; a directory without it is the leftover of
an unfinished run and is removed before the step is computed again. Finished steps are
looked up in the run's own cache first, then in `reuse_from` roots (read only).
"""
from __future__ import annotations

import json
from typing import Any

from data_curation import io, urls

DONE = "_DONE"


class StepDir:
    """A finished step directory (in the cache or a reuse_from location)."""

    def __init__(self, url: str, done: dict[str, Any]):
        self.url = url
        self.done = done

    def part_urls(self) -> list[tuple[str, str]]:
        """(part name, URL) of the parts holding the rows the step kept."""
        return [(p["name"], urls.join(self.url, "kept", p["name"] + ".parquet"))
                for p in self.done["parts"] if p["rows"]]

    def removed_urls(self) -> list[str]:
        return [urls.join(self.url, "removed", p["name"] + ".parquet")
                for p in self.done["parts"] if p.get("removed")]

    def quarantine_urls(self) -> list[str]:
        return [urls.join(self.url, "quarantine", p["name"] + ".parquet")
                for p in self.done["parts"] if p.get("quarantined")]

    def report(self, storage_options: dict) -> dict[str, Any]:
        return io.read_json(urls.join(self.url, "report.json"), storage_options)


def find_done(dirname: str, roots: list[str], storage_options: dict) -> StepDir | None:
    for root in roots:
        url = urls.join(root, "steps", dirname)
        marker = urls.join(url, DONE)
        if io.exists(marker, storage_options):
            return StepDir(url, io.read_json(marker, storage_options))
    return None


def start_dir(url: str, storage_options: dict) -> None:
    io.remove_tree(url, storage_options)   # leftovers of an unfinished run (no _DONE) are not trusted


def mark_done(url: str, done: dict[str, Any], report: dict[str, Any], storage_options: dict) -> StepDir:
    io.write_text(urls.join(url, "report.json"), json.dumps(report, indent=2, default=str), storage_options)
    io.write_text(urls.join(url, DONE), json.dumps(done, default=str), storage_options)
    return StepDir(url, done)
