#!/usr/bin/env bash
# vLLM for a GPU machine with no package index and a 64 MiB limit per transfer: the vllm wheel
# (its FlashAttention-2 kernels dropped: Hopper runs the FA3 / FlashInfer paths) unpacked, plus
# the wheels vLLM imports that the machine lacks, packed as one tar.xz and split into parts
# of at most PART_MB, one folder per part: .vllm/part1, .vllm/part2, ... (git-ignored).
#
#   scripts/gpu_wheels.sh && scripts/gpu_vllm.sh      # here
#   # there, one back-to-back call per part (carry [".vllm/partK"]; files outside the work
#   # tree survive while the machine stays warm):
#   mkdir -p /tmp/vllm_parts && cp .vllm/partK/* /tmp/vllm_parts/
#   # the last call then unpacks and installs next to the project's wheels (.whl):
#   mkdir -p /tmp/vllm_payload && cat /tmp/vllm_parts/vllm.tar.xz.* | xz -d | tar -x -C /tmp/vllm_payload
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/vllm_payload/wheels/*.whl
#   cp -r /tmp/vllm_payload/site/. /tmp/site/ && export PYTHONPATH=/tmp/site:$PWD
#
# vllm 0.26.0 pins torch 2.11 (CUDA 13), the GPU machines' torch; newer vLLM needs a newer torch.
# DEPS is the set of wheels that made vllm import and generate there, beside the GPU image's
# packages; the ones scripts/gpu_wheels.sh already puts in .whl are skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
VLLM_VERSION=${VLLM_VERSION:-0.26.0}
# 50: a call carries 64 MiB with the working tree (~6 MB tracked); 58 MiB parts were refused (round 13)
PART_MB=${PART_MB:-50}
DEPS="annotated-types==0.8.0 astor==0.8.1 blake3==1.0.11 cachetools==8.0.2 cbor2==6.3.0
compressed-tensors==0.17.0 depyf==0.20.0 dill==0.4.1 diskcache==5.6.3 distro==1.9.0 fastapi==0.136.3
frozendict==2.5.1 gguf==0.19.0 ijson==3.6.0 interegular==0.3.3 jiter==0.19.0 jsonschema==4.26.0
jsonschema-specifications==2025.9.1 lark==1.2.2 llguidance==1.7.6 lm-format-enforcer==0.11.3
loguru==0.7.3 mistral-common==1.13.1 msgspec==0.22.0 openai==3.57.0 httpx2==2.16.2 httpcore2==2.16.2
openai-harmony==0.0.8 outlines-core==0.2.14 partial-json-parser==0.2.1.1.post7
prometheus-fastapi-instrumentator==8.1.0 pybase64==1.5.1 pycountry==26.2.16 pydantic==2.14.4
pydantic-core==2.50.5 pydantic-extra-types==2.11.1 python-json-logger==4.2.0 pyzmq==27.3.0
referencing==0.37.0 rpds-py==2026.9.1 setproctitle==1.3.8 sniffio==1.3.1 starlette==1.10.0
typing-inspection==0.4.5 watchfiles==1.3.0 xgrammar==0.2.6 apache-tvm-ffi==0.1.10
flashinfer-python==0.6.14 nvidia-cudnn-frontend==1.32.0"

work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
platforms=$(for n in 17 24 27 28 31 34 35; do echo --platform manylinux_2_${n}_x86_64; done)
download() {  # args: dest, requirement...
  local dest=$1; shift
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    $platforms --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$dest" "$@" 2>&1 \
    | grep -v '^WARNING: Location' || true
}
download "$work/vllm" "vllm==$VLLM_VERSION"
mkdir -p "$work/payload/site" "$work/payload/wheels"
python3 -m zipfile -e "$work"/vllm/vllm-*.whl "$work/payload/site"
rm -f "$work"/payload/site/vllm/vllm_flash_attn/_vllm_fa2_C*.so
have=" $(ls .whl 2>/dev/null | sed -E 's/-[0-9].*//' | tr 'A-Z_.' 'a-z--' | tr '\n' ' ') "
need=()
for req in $DEPS; do
  name=$(echo "${req%%==*}" | tr 'A-Z_.' 'a-z--')
  [[ "$have" == *" $name "* ]] || need+=("$req")
done
download "$work/payload/wheels" "${need[@]}"
rm -rf .vllm; mkdir -p .vllm
tar -C "$work/payload" -cf - . | xz -9 -T0 >"$work/vllm.tar.xz"
split -b "${PART_MB}m" -d -a 2 "$work/vllm.tar.xz" "$work/vllm.tar.xz."
i=1
for part in "$work"/vllm.tar.xz.[0-9][0-9]; do
  mkdir -p ".vllm/part$i" && mv "$part" ".vllm/part$i/"; i=$((i + 1))
done
echo ".vllm: $((i - 1)) parts of <= ${PART_MB} MiB ($(du -sh "$work/vllm.tar.xz" | cut -f1) in all)"
