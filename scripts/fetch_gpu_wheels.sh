#!/usr/bin/env bash
# Download the wheels the offline GPU host lacks into .whl/ (git-ignored through
# .git/info/exclude), for Python 3.12 on x86_64: scripts/gpu_check.sh installs them.
# The set is the one ../shared/notes/gpu.md lists as known to work there (~60 MiB), plus
# llguidance for the structured step of scripts/gpu_check.sh (optional there: skipped
# without it). llguidance 1.7.0 and later come only as manylinux_2_31 wheels; the host's
# glibc is not recorded (its manylinux_2_28 wheels work: >= 2.28; gpu_check.sh logs it),
# so 1.6.1, the newest manylinux_2_28 one: llguidance-1.6.1-cp39-abi3-
# manylinux_2_28_x86_64.whl, 2.9 MiB, no dependencies (tests/test_structured_output.py
# passes with it; it takes one EOS id, engine/structured/compiler.py copes).
case "${1:-}" in
  -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
  "") ;;
  *) echo "fetch_gpu_wheels.sh: takes no arguments, got '$1' (see --help)" >&2; exit 2 ;;
esac
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >>.git/info/exclude
WHEELS=(
  nixl==1.5.1 nixl-cu13==1.5.1 pyzmq==27.3.0
  fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0
  pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.8.0 typing-inspection==0.4.5
  opentelemetry-api==1.45.2 importlib-metadata==10.2.0
  httptools==0.9.0  # uvicorn's parser, as in CI (h11 otherwise: works, ~0.2 ms slower per request)
  llguidance==1.6.1  # structured outputs (see above: the newest wheel for glibc 2.28)
)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl "${WHEELS[@]}"
du -sh .whl
