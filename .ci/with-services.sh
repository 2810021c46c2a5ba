#!/usr/bin/env bash
# Runs a command (`make test`: pytest) with the servers the store tests talk to, and stops them after it:
#   .ci/with-services.sh VENV_DIR COMMAND [ARGS...]
# .ci/services.sh starts redis-server (apt-installing it when missing and allowed) and a moto S3 server on
# 127.0.0.1, except those whose URL is already set (VERICACHE_REDIS_URL, VERICACHE_S3_ENDPOINT: servers of
# your own). A server that cannot start does not stop the run: its tests skip with the reason (fail in CI,
# CI=true), and the run ends with a line naming what was skipped and why (tests/conftest.py).
# Exit status: the command's.
set -uo pipefail
venv="${1:?usage: .ci/with-services.sh VENV_DIR COMMAND [ARGS...]}"
shift
# exit (and so the EXIT trap that stops the servers) on Ctrl-C or a kill as well
trap 'exit 130' INT
trap 'exit 143' TERM
# shellcheck source=.ci/services.sh
source "${0%/*}/services.sh" "$venv" || echo "[services] not all started: their tests will skip" >&2
"$@"
rc=$?
if declare -F vericache_stop_services >/dev/null; then vericache_stop_services; fi
exit $rc
