#!/usr/bin/env bash
# Installs memory-server (CPU torch) into ./.venv and starts it on the embedded default
# (SQLite + Qdrant Edge in ./memory-data, http://127.0.0.1:8000). Extra arguments go to `serve`.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install.sh
exec .venv/bin/memory-server serve "$@"
