"""A module whose import sets a variable, as DeepSpeed's sets PYTORCH_NVML_BASED_CUDA_CHECK
(tests/pipeline/test_job_server.py)."""
from __future__ import annotations

import os

os.environ.setdefault("WARM_SET_BY_IMPORT", "set by the import")
