#!/usr/bin/env bash
# Wheels for a GPU machine that has torch/transformers/triton but not the rest of our stack
# (deepspeed, prefect, mlflow, datasets, pydantic, ...) and no package index: resolve our
# runtime dependencies for its Python, drop what its image already holds, download the rest as
# manylinux wheels into .whl/ (git-ignored) and build deepspeed's pure-Python wheel.
#
#   scripts/gpu_wheels.sh            # -> .whl/*.whl
#   # on the GPU machine, from the repo root (wheels carried there):
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
#   export PYTHONPATH=/tmp/site:$PWD
#
# PRESENT lists the GPU image's preinstalled distributions (its torch/CUDA stack must not be
# replaced). SKIP lists what a GPU run does not use: the S3 client stack (file:// storage
# there) and mlflow's UI/server bundle (mlflow-skinny carries the tracking client; sqlalchemy
# and alembic come along for the sqlite store).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON_VERSION=${PYTHON_VERSION:-3.12}
TORCH_VERSION=${TORCH_VERSION:-2.11.0}
OUT=${OUT_DIR:-.whl}

PRESENT="absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch
build certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cupy-
cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools
formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize
hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib
jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax
llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath
msgpack multidict multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda
numpy numpyro onnx onnx-ir onnxruntime onnxscript opencv-python-headless opt-einsum opt-einsum-fx
optax optimistix orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy portalocker
prometheus-client propcache protobuf psutil py-cpuinfo pyarrow pybind11 pygments pyparsing
pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout
pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors
scikit-build-core scikit-image scikit-learn scipy seaborn sentence-transformers sentencepiece
setuptools shellingham simplejson six sortedcontainers statsmodels sympy tabulate tensorboard
tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz torch
torch-geometric torchaudio torchdiffeq torchmetrics torchvision tqdm transformers treescope triton
typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray
xxhash yarl zipp"
SKIP="aiobotocore aioitertools botocore s3fs jmespath s3transfer boto3 mlflow docker gunicorn"

if command -v uv >/dev/null 2>&1; then uv=(uv); else
  tools=$(mktemp -d); trap 'rm -rf "$tools"' EXIT
  python3 -m venv "$tools" && "$tools/bin/pip" install -q uv; uv=("$tools/bin/uv"); fi

resolved=$(mktemp); pin=$(mktemp)
echo "torch==${TORCH_VERSION}" >"$pin"
"${uv[@]}" pip compile pyproject.toml --python-version "$PYTHON_VERSION" --python-platform x86_64-manylinux_2_28 \
  -c "$pin" --no-annotate --no-header --quiet -o "$resolved"
norm() { tr 'A-Z_.' 'a-z--'; }
wanted=$(mktemp)
while IFS= read -r line; do
  [[ -z "$line" || "$line" == \#* ]] && continue
  name=$(echo "${line%%==*}" | norm)
  [[ " $(echo $PRESENT $SKIP) " == *" $name "* || "$name" == nvidia-* || "$name" == cuda-* ]] && continue
  echo "$line"
done <"$resolved" >"$wanted"

rm -rf "$OUT"; mkdir -p "$OUT"
# Pure-Python projects published as sdists only: built into wheels here (deepspeed's ops
# JIT-build at run time, so its wheel needs no torch at build time). BUILD_THERE: sdists with C
# code (reasoning-gym's pycosat), copied as they are: the GPU machine's Python (3.12) builds them
# (benchmarks/gpu_plans/session.sh start does, before installing the wheels).
SDIST_ONLY="deepspeed langdetect cellpylib zss"
BUILD_THERE="pycosat"
sdist_re="^($(echo $SDIST_ONLY $BUILD_THERE | tr ' ' '|'))=="
grep -Ev "$sdist_re" "$wanted" >"$resolved"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYTHON_VERSION" --implementation cp \
  $(for n in 17 24 27 28 31 34; do echo --platform manylinux_2_${n}_x86_64; done) \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$OUT" -r "$resolved" 2>&1 | grep -v '^WARNING: Location' || true
for req in $(grep -E "$sdist_re" "$wanted" || true); do
  src=$(mktemp -d); python3 -m pip download -q --no-deps --no-binary=:all: -d "$src" "$req" 2>&1 | grep -v '^WARNING: Location' || true
  if [[ " $BUILD_THERE " == *" ${req%%==*} "* ]]; then cp "$src"/* "$OUT"/
  else python3 -m pip wheel -q --no-deps --no-build-isolation -w "$OUT" "$src"/* 2>&1 | grep -v '^WARNING: Location' || true; fi
  rm -rf "$src"
done
# a wheel that did not build is an error here, not a ModuleNotFoundError on the device (round 11b:
# deepspeed's build needs setuptools with bdist_wheel and torch: run this from the project's venv)
for name in $SDIST_ONLY; do
  if grep -qiE "^${name}==" "$wanted" && ! ls "$OUT" | grep -qi "^${name//-/_}-.*\.whl$"; then
    echo "gpu_wheels: no wheel was built for $name (run from the project's venv)" >&2; exit 1
  fi
done
rm -f "$resolved" "$pin" "$wanted"
echo "$OUT: $(ls "$OUT" | wc -l) wheels, $(du -sh "$OUT" | cut -f1)"
