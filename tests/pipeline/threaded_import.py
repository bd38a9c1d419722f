"""A module whose import starts a thread (tests/pipeline/test_job_server.py: a warm server must not
fork with it running)."""
from __future__ import annotations

import threading
import time

threading.Thread(target=time.sleep, args=(600,), name="started-at-import", daemon=True).start()
