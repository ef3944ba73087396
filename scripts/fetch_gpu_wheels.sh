#!/usr/bin/env bash
# Download the wheels the offline GPU host lacks into .whl/ (git-ignored through
# .git/info/exclude), for Python 3.12 on x86_64: scripts/gpu_check.sh installs them.
# The set is the one ../shared/notes/gpu.md lists as known to work there (~60 MiB).
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
)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl "${WHEELS[@]}"
du -sh .whl
