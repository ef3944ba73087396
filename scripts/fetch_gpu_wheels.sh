#!/usr/bin/env bash
# Download the wheels the offline GPU host lacks into .whl/ (git-ignored through
# .git/info/exclude), for Python 3.12 on x86_64: scripts/gpu_check.sh installs them.
# The set is the one ../shared/notes/gpu.md lists as known to work there (~60 MiB) less
# fastapi and pydantic, plus llguidance for the structured step of scripts/gpu_check.sh
# only with GPU_WHEELS_STRUCTURED=1 (optional there: skipped without it; see below):
# 1.6.1, the newest manylinux_2_28 wheel (llguidance-1.6.1-cp39-abi3-
# manylinux_2_28_x86_64.whl, 2.9 MiB, no dependencies; tests/test_structured_output.py
# passes with it; it takes one EOS id, engine/structured/compiler.py copes). The host's
# glibc is 2.39 (gpu_check.sh's log, 2026-12-04), so later manylinux_2_31 wheels would do.
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
  starlette==1.10.0 uvicorn==0.54.0
  httptools==0.9.0  # uvicorn's parser, as in CI (h11 otherwise: works, ~0.2 ms slower per request)
)
# The device tool carries the tree and .whl/ under 64 MiB together; nixl-cu13 alone is
# 59 MB and the tree ~5 MB, so llguidance (3 MB) does not fit beside it: only with
# GPU_WHEELS_STRUCTURED=1, for a run of the structured step alone (GPU_CHECK_ONLY=structured,
# with nixl's wheels moved out of .whl/). fastapi and pydantic (in the set known to work
# there) are left out: pdserve does not import them (2026-12-04: the run without them
# passed every step).
if [ "${GPU_WHEELS_STRUCTURED:-0}" = 1 ]; then
  WHEELS+=(llguidance==1.6.1)  # the newest wheel for glibc 2.28 (see above)
fi
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl "${WHEELS[@]}"
du -sh .whl
