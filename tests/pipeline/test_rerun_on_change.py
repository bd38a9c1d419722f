"""A stage reruns when the content of an input changes (and so do the stages after it),
is skipped when the content is the same, and `plan` / `status` say why."""
from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pipeline.cli import app
from pipeline.loader import load_recipe
from pipeline.plan import make_plan

runner = CliRunner()

RECIPE = """\
name: inputs
storage: {{url: "{store}", options: {options}}}
defaults: {{work_dir: "{work}"}}
stages:
  base:
    kind: init_model
    architecture: {{hidden_size: 32, num_attention_heads: 4, num_key_value_heads: 2}}
    tokenizer: {{corpus: ["{corpus}"]}}
  cur:
    kind: curate
    data: ["{rows_dir}", "{s3_prefix}"]
  sft:
    kind: sft
    model: ${{stages.base.output}}
    data: ${{stages.cur.output}}/curated.jsonl
"""


def _write_recipe(tmp_path, store, options, s3_prefix):
    path = tmp_path / "inputs.yaml"
    path.write_text(textwrap.dedent(RECIPE.format(
        store=store, options=json.dumps(options), work=tmp_path / "work", corpus=tmp_path / "corpus.jsonl",
        rows_dir=tmp_path / "rows", s3_prefix=s3_prefix)))
    return path


def _done(recipe_path) -> dict[str, bool]:
    plan = make_plan(load_recipe(recipe_path))
    return {s.name: s.done for s in plan.stages}


def _publish_all(recipe_path, tmp_path):
    """Mark every planned stage published (the store contract `run` skips on)."""
    plan = make_plan(load_recipe(recipe_path))
    out = tmp_path / "stub"
    out.mkdir(exist_ok=True)
    (out / "model.txt").write_text("stub")
    for s in plan.stages:
        plan.store.publish(out, s.url, {"stage": s.name, "hash": s.hash})


def test_input_content_decides_what_reruns(tmp_path, s3_bucket):
    import fsspec

    bucket, opts = s3_bucket
    fs = fsspec.filesystem("s3", **opts)
    fs.pipe({f"{bucket[5:]}/raw/a.jsonl": b'{"text": "a"}\n', f"{bucket[5:]}/raw/b.jsonl": b'{"text": "b"}\n'})
    (tmp_path / "corpus.jsonl").write_text('{"text": "hello"}\n')
    (tmp_path / "rows").mkdir()
    (tmp_path / "rows" / "part-0.jsonl").write_text('{"messages": []}\n' * 420)
    recipe = _write_recipe(tmp_path, f"file://{tmp_path}/store", opts, f"{bucket}/raw/")
    assert _done(recipe) == {"base": False, "cur": False, "sft": False}
    _publish_all(recipe, tmp_path)
    assert _done(recipe) == {"base": True, "cur": True, "sft": True}

    # unchanged content (rewritten with the same bytes, re-uploaded as is): nothing reruns
    (tmp_path / "rows" / "part-0.jsonl").write_text('{"messages": []}\n' * 420)
    fs.pipe(f"{bucket[5:]}/raw/a.jsonl", b'{"text": "a"}\n')
    assert _done(recipe) == {"base": True, "cur": True, "sft": True}

    # a file of the directory shrinks in place: curate reruns, and sft after it
    (tmp_path / "rows" / "part-0.jsonl").write_text('{"messages": []}\n' * 50)
    assert _done(recipe) == {"base": True, "cur": False, "sft": False}
    _publish_all(recipe, tmp_path)

    # an object under the s3:// prefix changes
    fs.pipe(f"{bucket[5:]}/raw/b.jsonl", b'{"text": "B"}\n')
    assert _done(recipe) == {"base": True, "cur": False, "sft": False}
    _publish_all(recipe, tmp_path)

    # the tokenizer corpus of the first stage changes: everything after it reruns
    (tmp_path / "corpus.jsonl").write_text('{"text": "hello again"}\n')
    assert _done(recipe) == {"base": False, "cur": True, "sft": False}


@pytest.mark.slow
def test_plan_names_the_changed_input_and_status_the_drifted_code(tmp_path, monkeypatch):
    from pipeline.execute import ExecutionPolicy, StageTarget, execute

    monkeypatch.chdir(tmp_path)
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"{i} + {i} = {2 * i}"}) + "\n" for i in range(40)))
    recipe = tmp_path / "one.yaml"
    recipe.write_text(textwrap.dedent(f"""\
        name: one
        storage: {{url: "file://{tmp_path}/store"}}
        defaults: {{work_dir: "{tmp_path}/work"}}
        stages:
          base:
            kind: init_model
            architecture: {{hidden_size: 32, num_attention_heads: 4, num_key_value_heads: 2}}
            tokenizer: {{corpus: ["corpus.jsonl"]}}
        """))

    def execute_base():
        plan = make_plan(load_recipe(recipe))
        return execute(StageTarget.of(plan["base"]), plan.store, tmp_path / "work",
                       ExecutionPolicy.of(plan.recipe.storage))

    first = execute_base()
    assert first.status == "ran"
    manifest_path = Path(first.url.removeprefix("file://")) / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    assert manifest["inputs"]["corpus.jsonl"]["kind"] == "file"
    assert manifest["code"]["digest"] and manifest["code"]["version"] == 1

    corpus.write_text(corpus.read_text())  # same bytes, new mtime
    assert execute_base().status == "skipped"

    original = corpus.read_text()
    corpus.write_text(original + json.dumps({"text": "one more row"}) + "\n")
    res = runner.invoke(app, ["plan", str(recipe)])
    assert res.exit_code == 0, res.output
    assert "to run" in res.output
    assert "why:      input corpus.jsonl changed: file: 1 file" in res.output, res.output
    corpus.write_text(original)  # back to the published content: done again
    assert "done" in runner.invoke(app, ["plan", str(recipe)]).output

    # the stage kind's code changed since (recorded digest differs), its version did not
    manifest["code"]["digest"] = "0123456789abcdef"
    manifest_path.write_text(json.dumps(manifest))
    for command in ("plan", "status"):
        res = runner.invoke(app, [command, str(recipe)])
        assert res.exit_code == 0, res.output
        assert "the code of init_model changed since this artifact was made (source digest " \
               "0123456789abcdef ->" in res.output, res.output
        assert "--force base" in res.output
    assert "base             done" in runner.invoke(app, ["status", str(recipe)]).output
