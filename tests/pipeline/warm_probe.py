"""`python -m tests.pipeline.warm_probe [ok|exit3|raise|kill|sleep|wait FILE]`: a job that prints what it sees
as one `FACTS {json}` line (to stdout; a line to stderr too), then does what it was told."""
from __future__ import annotations

import json
import os
import sys
import time

facts = {"torch_at_start": "torch" in sys.modules, "email_at_start": "email.mime.text" in sys.modules,
         "mlflow_store_at_start": "mlflow.store.tracking.sqlalchemy_store" in sys.modules, "argv": sys.argv[1:], "cwd": os.getcwd(),
         "variable": os.environ.get("WARM_PROBE"), "omp": os.environ.get("OMP_NUM_THREADS"), "credential": os.environ.get("WARM_CREDENTIAL"),
         "compile_backend": os.environ.get("RING_COMPILE_BACKEND"),
         "pid": os.getpid(), "ppid": os.getppid(),  # the guard's parent next (the server, or the launcher)
         "guard_parent": int(open(f"/proc/{os.getppid()}/stat").read().rsplit(")", 1)[1].split()[1]), "sid": os.getsid(0), "pgid": os.getpgid(0),
         "stdin": sys.stdin.read(), "main": __name__,
         "title": open("/proc/self/cmdline").read().replace("\0", " ").strip()}
if "torch" in sys.modules:  # a server that warmed torch: the thread count it left to the job
    facts["threads"] = sys.modules["torch"].get_num_threads()
print("FACTS " + json.dumps(facts), flush=True)
print("a line on stderr", file=sys.stderr, flush=True)
what = sys.argv[1] if len(sys.argv) > 1 else "ok"
if what == "exit3":
    sys.exit(3)
if what == "raise":
    raise ValueError("the warm probe failed")
if what == "kill":
    os.kill(os.getpid(), 9)
if what == "sleep":
    time.sleep(300)
if what == "wait":  # until the file named next exists
    deadline = time.time() + 120
    while not os.path.exists(sys.argv[2]) and time.time() < deadline:
        time.sleep(0.1)
