#!/usr/bin/env bash
# Installs memory-server with its test dependencies into ./.venv and runs the whole suite.
# PostgreSQL: when MEMORY_SERVER_TEST_POSTGRES_URL is set (an admin URL such as
# postgresql://postgres@127.0.0.1:5432/postgres), every storage test also runs on PostgreSQL.
# Browser tests need Chromium at /usr/bin/chromium (Debian: apt-get install -y chromium).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install.sh test
export HF_HUB_OFFLINE=1
exec .venv/bin/python -m pytest "$@"
