"""`ring-pipeline gc` on a store and work dir with every kind of leftover: the dry run lists
exactly what the real run then removes, and nothing the current plan or a live run needs."""
from __future__ import annotations

import os
import re
import textwrap
import time
from pathlib import Path

from typer.testing import CliRunner

from pipeline.cli import app
from pipeline.lease import try_acquire
from pipeline.loader import load_recipe
from pipeline.plan import make_plan
from stages.common.artifact_inputs import verify_artifact
from stages.common.checkpoint_store import CheckpointStore

runner = CliRunner()
TEN_DAYS = 10 * 86400


def _age(path: Path, seconds: float) -> None:
    t = time.time() - seconds
    for p in [path, *path.rglob("*")]:
        os.utime(p, (t, t))


def _files(tmp_path, name: str) -> Path:
    d = tmp_path / "src" / name
    d.mkdir(parents=True)
    (d / "weights.bin").write_bytes(name.encode() * 100)
    return d


def test_gc_dry_run_then_delete(tmp_path):
    recipe = tmp_path / "gcr.yaml"
    recipe.write_text(textwrap.dedent(f"""\
        name: gcr
        storage: {{url: "file://{tmp_path}/store", keep_checkpoints: 1}}
        defaults: {{work_dir: "{tmp_path}/work"}}
        stages:
          data:
            kind: synthetic_data
            files: {{sft.jsonl: {{generator: arithmetic_cot, n: 10}}}}
          base:
            kind: init_model
            architecture: {{hidden_size: 32, num_attention_heads: 4, num_key_value_heads: 2}}
            tokenizer: {{corpus: ["${{stages.data.output}}/sft.jsonl"]}}
        """))
    plan = make_plan(load_recipe(recipe))
    store, root = plan.store, tmp_path / "store" / "gcr"
    # the current plan: both stages published, base with its last two checkpoints (20, 30)
    for s in plan.stages:
        store.publish(_files(tmp_path, s.name), s.url, {"stage": s.name, "hash": s.hash})
    for step in (10, 20, 30):
        CheckpointStore(plan["base"].url, {}).save(_files(tmp_path, f"ck{step}"), step)
    # older hashes of base: two published (the newer is kept), one failed attempt, all old
    for h in ("bbbbbbbbbbbb", "aaaaaaaaaaaa"):
        store.publish(_files(tmp_path, h), f"{store.root}/base-{h}", {"stage": "base", "hash": h})
    CheckpointStore(f"{store.root}/base-cccccccccccc", {}).save(_files(tmp_path, "ckc"), 5)
    store.write_note(f"{store.root}/base-cccccccccccc", "_FAILED", {"error": "boom"})
    # an old-hash attempt running right now, and a recent failed one
    live = try_acquire(f"{store.root}/base-dddddddddddd", {}, 3600, {})
    CheckpointStore(f"{store.root}/base-eeeeeeeeeeee", {}).save(_files(tmp_path, "cke"), 5)
    for h in ("aaaaaaaaaaaa", "bbbbbbbbbbbb", "cccccccccccc", "dddddddddddd"):
        _age(root / f"base-{h}", TEN_DAYS)
    # work dirs: attempts of a published stage, of an old failed hash, of the live run, a recent one
    work = tmp_path / "work" / "gcr"
    attempts = {
        "done": work / plan["data"].url.rsplit("/", 1)[-1] / "20250101T000000-1-aaaaaa",
        "stale": work / "base-cccccccccccc" / "20250101T000000-2-bbbbbb",
        "live": work / "base-dddddddddddd" / live.owner,
        "recent": work / "base-eeeeeeeeeeee" / "20250101T000000-3-cccccc",
    }
    for a in attempts.values():
        (a / "output").mkdir(parents=True)
        (a / "stage.log").write_text("log\n")
    _age(attempts["stale"], TEN_DAYS)
    _age(attempts["live"], TEN_DAYS)  # old files, but its lease is live

    expected = {
        ("checkpoint", f"{plan['base'].url}/checkpoints/step-00000020"),
        ("artifact", f"{store.root}/base-bbbbbbbbbbbb"),
        ("artifact", f"{store.root}/base-cccccccccccc"),
        ("work", str(attempts["done"])),
        ("work", str(attempts["stale"])),
    }

    def listed(output: str) -> set[tuple[str, str]]:
        return {m.groups() for m in re.finditer(r"^(?:would remove|removing) (\S+)\s+(\S+)", output, re.M)}

    try:
        dry = runner.invoke(app, ["gc", str(recipe)])
        assert dry.exit_code == 0, dry.output
        assert listed(dry.output) == expected, dry.output
        assert "5 to remove (dry run: add --delete)" in dry.output
        assert (root / "base-bbbbbbbbbbbb").exists() and attempts["done"].exists()  # nothing removed

        real = runner.invoke(app, ["gc", str(recipe), "--delete"])
        assert real.exit_code == 0, real.output
        assert listed(real.output) == expected and "5 removed" in real.output
        assert not (root / "base-bbbbbbbbbbbb").exists() and not (root / "base-cccccccccccc").exists()
        assert not attempts["done"].exists() and not attempts["stale"].exists()
        for kept in ("base-aaaaaaaaaaaa", "base-dddddddddddd", "base-eeeeeeeeeeee"):
            assert (root / kept).exists(), kept
        assert attempts["live"].exists() and attempts["recent"].exists()
        assert CheckpointStore(plan["base"].url, {}).steps() == [30]
        for s in plan.stages:
            verify_artifact(s.url)  # the current artifacts are whole
        again = runner.invoke(app, ["gc", str(recipe), "--keep-checkpoints", "0"])
        assert listed(again.output) == {("checkpoint", f"{plan['base'].url}/checkpoints/step-00000030")}
    finally:
        live.release()
