"""Recipe files for the end-to-end runs: store, MLflow DB and work dirs under the test's dir."""
from __future__ import annotations

import textwrap
from pathlib import Path

from tests.mlflow_db import tracking_uri


def local_recipe(root: Path, name: str, stages: str) -> Path:
    """`root/name.yaml` with the given `stages:` body (YAML, unindented)."""
    path = root / f"{name}.yaml"
    path.write_text(f'name: {name}\n'
                    f'storage: {{url: "file://{root}/store"}}\n'
                    f'tracking: {{uri: "{tracking_uri(root)}"}}\n'
                    f'defaults: {{work_dir: "{root}/work"}}\n'
                    "stages:\n" + textwrap.indent(textwrap.dedent(stages), "  "))
    return path


def data_and_base(rows: int, corpus: str = "sft.jsonl") -> str:
    """Two quick stages: synthetic chats, and a tiny model whose tokenizer trains on `corpus`
    of the first stage's output."""
    return f"""\
        data:
          kind: synthetic_data
          files:
            sft.jsonl: {{generator: arithmetic_cot, n: {rows}}}
        base:
          kind: init_model
          architecture: {{hidden_size: 32, num_attention_heads: 4, num_key_value_heads: 2}}
          tokenizer: {{corpus: ["${{stages.data.output}}/{corpus}"]}}
        """
