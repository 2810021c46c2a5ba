# shellcheck shell=bash
# Installs (Debian redis-server) and starts the stores the storage tests talk to, on loopback only.
#   source .ci/services.sh [VENV_DIR]      (default: .venv)
# `make test` does this itself (.ci/with-services.sh). Exports VERICACHE_REDIS_URL, VERICACHE_S3_ENDPOINT
# (+ dummy AWS test credentials when none are set) and defines vericache_stop_services. A URL already set
# (a server of your own) is left alone. A service that cannot start exports VERICACHE_REDIS_DOWN /
# VERICACHE_S3_DOWN, the reason, which the skipped tests print; the other still starts. Sourced: never `exit`.
# VERICACHE_SKIP_INSTALL=1 skips the apt step (redis-server must already be there).

_vc_venv="${1:-.venv}"
_vc_py="$_vc_venv/bin/python"
_vc_pip="$_vc_venv/bin/pip"
_vc_state="${VERICACHE_SERVICES_DIR:-}"
_vc_own_state=0  # a temporary folder of ours: removed when the servers stop
if [ -z "$_vc_state" ]; then _vc_state="$(mktemp -d /tmp/vericache-services.XXXXXX)"; _vc_own_state=1; fi
mkdir -p "$_vc_state"

_vc_log() { echo "[services] $*" >&2; }

_vc_free_port() {
  "$_vc_py" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1]); s.close()'
}

_vc_install() {
  command -v redis-server >/dev/null 2>&1 && return 0
  local sudo=""
  if ! command -v apt-get >/dev/null 2>&1; then
    _vc_why="redis-server is not installed (no apt-get here: install it with your package manager)"; return 1
  fi
  if [ "$(id -u)" != 0 ]; then
    if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then sudo="sudo -n"; else
      _vc_why="redis-server is not installed and installing it needs root (sudo apt-get install redis-server)"
      return 1
    fi
  fi
  _vc_log "installing redis-server (apt)"
  ($sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq redis-server) \
    >"$_vc_state/apt.log" 2>&1 || {
    tail -20 "$_vc_state/apt.log" >&2
    _vc_why="apt-get install redis-server failed (log: $_vc_state/apt.log)"; return 1; }
  # Python packages (redis, boto3, moto[server], lmcache, nixl) come from `make install`.
}

_vc_wait() {  # _vc_wait NAME SECONDS PYTHON_SNIPPET
  local name="$1" secs="$2" code="$3" i
  for ((i = 0; i < secs * 10; i++)); do
    if "$_vc_py" -c "$code" >/dev/null 2>&1; then _vc_log "$name is up"; return 0; fi
    sleep 0.1
  done
  _vc_why="$name did not answer within ${secs}s"
  return 1
}

_vc_start_redis() {
  command -v redis-server >/dev/null 2>&1 || { _vc_why="redis-server is not installed"; return 1; }
  local port; port="$(_vc_free_port)" || { _vc_why="no free port ($_vc_py did not run)"; return 1; }
  redis-server --bind 127.0.0.1 --port "$port" --save "" --appendonly no --protected-mode yes \
    --dir "$_vc_state" --daemonize yes --pidfile "$_vc_state/redis.pid" \
    --logfile "$_vc_state/redis.log" || { _vc_why="redis-server failed (log: $_vc_state/redis.log)"; return 1; }
  _vc_wait redis-server 20 "import socket; s=socket.create_connection(('127.0.0.1',$port),1); s.sendall(b'PING\r\n'); assert s.recv(16).startswith(b'+PONG')" || {
    tail -20 "$_vc_state/redis.log" >&2; _vc_why="$_vc_why (log: $_vc_state/redis.log)"; return 1; }
  export VERICACHE_REDIS_URL="redis://127.0.0.1:$port/0"
}

_vc_start_moto() {
  if [ ! -x "$_vc_venv/bin/moto_server" ]; then
    _vc_why="$_vc_venv/bin/moto_server is not installed (make install: moto[server])"; return 1
  fi
  local port; port="$(_vc_free_port)" || { _vc_why="no free port ($_vc_py did not run)"; return 1; }
  "$_vc_venv/bin/moto_server" -H 127.0.0.1 -p "$port" >"$_vc_state/moto.log" 2>&1 &
  echo $! >"$_vc_state/moto.pid"
  _vc_wait moto_server 60 "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$port/moto-api/', timeout=1)" || {
    tail -20 "$_vc_state/moto.log" >&2; _vc_why="$_vc_why (log: $_vc_state/moto.log)"; return 1; }
  export VERICACHE_S3_ENDPOINT="http://127.0.0.1:$port"
  # moto accepts any credentials; these are test dummies, set only when none are given.
  export AWS_ACCESS_KEY_ID="${AWS_ACCESS_KEY_ID:-testing}"
  export AWS_SECRET_ACCESS_KEY="${AWS_SECRET_ACCESS_KEY:-testing}"
  export AWS_DEFAULT_REGION="${AWS_DEFAULT_REGION:-us-east-1}"
}

vericache_stop_services() {
  local f pid pids="" i
  for f in "$_vc_state/redis.pid" "$_vc_state/moto.pid"; do
    if [ -f "$f" ]; then
      pid="$(cat "$f")"
      [ -n "$pid" ] && kill "$pid" 2>/dev/null && pids="$pids $pid"
      rm -f "$f"
    fi
  done
  pid=""
  for ((i = 0; i < 100; i++)); do  # until they have exited (10 s at most): their ports are free again
    for pid in $pids; do kill -0 "$pid" 2>/dev/null && break; pid=""; done
    [ -z "${pid:-}" ] && break
    sleep 0.1
  done
  # kept when a server failed to start: the skip reasons name its log there
  if [ "$_vc_own_state" = 1 ] && [ "${_vc_rc:-1}" = 0 ]; then rm -rf "$_vc_state"; fi
}

_vc_rc=0
_vc_why=""
if [ -n "${VERICACHE_REDIS_URL:-}" ]; then
  _vc_log "VERICACHE_REDIS_URL is set: using that Redis"
else
  unset VERICACHE_REDIS_DOWN
  if { [ "${VERICACHE_SKIP_INSTALL:-0}" = 1 ] || _vc_install; } && _vc_start_redis; then
    _vc_log "VERICACHE_REDIS_URL=$VERICACHE_REDIS_URL"
  else
    _vc_rc=1
    export VERICACHE_REDIS_DOWN="redis-server could not start: ${_vc_why:-redis-server is not installed}"
    _vc_log "$VERICACHE_REDIS_DOWN"
  fi
fi
if [ -n "${VERICACHE_S3_ENDPOINT:-}" ]; then
  _vc_log "VERICACHE_S3_ENDPOINT is set: using that S3 endpoint"
else
  unset VERICACHE_S3_DOWN
  if _vc_start_moto; then
    _vc_log "VERICACHE_S3_ENDPOINT=$VERICACHE_S3_ENDPOINT"
  else
    _vc_rc=1
    export VERICACHE_S3_DOWN="moto_server (S3) could not start: $_vc_why"
    _vc_log "$VERICACHE_S3_DOWN"
  fi
fi
if [ -z "$(trap -p EXIT)" ]; then trap vericache_stop_services EXIT; fi
# shellcheck disable=SC2317
return $_vc_rc 2>/dev/null || exit $_vc_rc
