"""Code versions: a comment, docstring or formatting edit changes neither the stage hash nor
the recorded source digest; a code edit changes the digest (a warning) but not the hash; a
version bump changes the hash."""
from __future__ import annotations

import dataclasses
import sys
import textwrap

from pipeline.changes import code_drift
from pipeline.plan import stage_hash
from stages.registry import STAGE_KINDS, StageKind

SOURCE = '''\
"""A stage's entry module."""
import math


def score(x):
    """The score of x."""
    return math.sqrt(x) + 1
'''


def _kind(pkg_name: str, version: int = 1) -> StageKind:
    sft = STAGE_KINDS["sft"]
    for mod in [m for m in sys.modules if m == pkg_name or m.startswith(pkg_name + ".")]:
        del sys.modules[mod]
    return StageKind(name="probe", config=sft.config, entry=f"{pkg_name}.job", sources=(pkg_name,),
                     version=version)


def test_only_code_changes_move_the_digest_and_only_versions_move_the_hash(tmp_path, monkeypatch):
    pkg = tmp_path / "probe_stage_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "job.py").write_text(SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = STAGE_KINDS["sft"].config.model_validate({"model": "m", "data": "d"})

    original = _kind("probe_stage_pkg")
    digest, h = original.code_version, stage_hash(original, cfg, {}, {})

    (pkg / "job.py").write_text(textwrap.dedent('''\
        """A stage's entry module, now documented at length."""
        import math  # for sqrt


        def score(x):
            """The score of x: one more than its square root."""
            # the square root, shifted
            return math.sqrt( x )+1
        '''))
    cosmetic = _kind("probe_stage_pkg")
    assert cosmetic.code_version == digest
    assert stage_hash(cosmetic, cfg, {}, {}) == h
    manifest = {"code": {"version": 1, "digest": digest, "git_commit": None}}
    assert code_drift("s", cosmetic, manifest) is None

    (pkg / "job.py").write_text(SOURCE.replace("+ 1", "+ 2"))
    edited = _kind("probe_stage_pkg")
    assert edited.code_version != digest
    assert stage_hash(edited, cfg, {}, {}) == h  # same declared version: results reused...
    warning = code_drift("s", edited, manifest)  # ...with a warning naming both digests
    assert digest in warning and edited.code_version in warning and "--force s" in warning

    bumped = dataclasses.replace(edited, version=2)
    assert stage_hash(bumped, cfg, {}, {}) != h
