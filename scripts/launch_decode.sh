#!/usr/bin/env bash
# Start ONE decode node in the background; same flags and environment as
# scripts/launch_prefill.sh (default port 8200). See that script for the details.
ROLE=decode exec "$(dirname "$0")/launch_prefill.sh" "$@"
