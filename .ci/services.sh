# shellcheck shell=bash
# Installs (Debian redis-server) and starts the stores the storage tests talk to, on loopback only.
#   source .ci/services.sh [VENV_DIR]      (default: .venv)
# Exports VERICACHE_REDIS_URL, VERICACHE_S3_ENDPOINT (+ dummy AWS test credentials
# when none are set) and defines vericache_stop_services.  Sourced: never `exit`.
# VERICACHE_SKIP_INSTALL=1 skips the apt/pip steps (servers must already be there).

_vc_venv="${1:-.venv}"
_vc_py="$_vc_venv/bin/python"
_vc_pip="$_vc_venv/bin/pip"
_vc_state="${VERICACHE_SERVICES_DIR:-$(mktemp -d /tmp/vericache-services.XXXXXX)}"
mkdir -p "$_vc_state"

_vc_log() { echo "[services] $*" >&2; }

_vc_free_port() {
  "$_vc_py" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1]); s.close()'
}

_vc_install() {
  if ! command -v redis-server >/dev/null 2>&1; then
    _vc_log "installing redis-server (apt)"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server) >"$_vc_state/apt.log" 2>&1 \
      || { _vc_log "apt-get install redis-server failed, see $_vc_state/apt.log"; tail -20 "$_vc_state/apt.log" >&2; return 1; }
  fi
  # Python packages (redis, boto3, moto[server], lmcache, nixl) come from `make install`.
}

_vc_wait() {  # _vc_wait NAME SECONDS PYTHON_SNIPPET
  local name="$1" secs="$2" code="$3" i
  for ((i = 0; i < secs * 10; i++)); do
    if "$_vc_py" -c "$code" >/dev/null 2>&1; then _vc_log "$name is up"; return 0; fi
    sleep 0.1
  done
  _vc_log "$name did not answer within ${secs}s"
  return 1
}

_vc_start_redis() {
  local port; port="$(_vc_free_port)" || return 1
  redis-server --bind 127.0.0.1 --port "$port" --save "" --appendonly no --protected-mode yes \
    --dir "$_vc_state" --daemonize yes --pidfile "$_vc_state/redis.pid" \
    --logfile "$_vc_state/redis.log" || return 1
  _vc_wait redis 20 "import socket; s=socket.create_connection(('127.0.0.1',$port),1); s.sendall(b'PING\r\n'); assert s.recv(16).startswith(b'+PONG')" || {
    tail -20 "$_vc_state/redis.log" >&2; return 1; }
  export VERICACHE_REDIS_URL="redis://127.0.0.1:$port/0"
}

_vc_start_moto() {
  local port; port="$(_vc_free_port)" || return 1
  "$_vc_venv/bin/moto_server" -H 127.0.0.1 -p "$port" >"$_vc_state/moto.log" 2>&1 &
  echo $! >"$_vc_state/moto.pid"
  _vc_wait moto_server 60 "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$port/moto-api/', timeout=1)" || {
    tail -20 "$_vc_state/moto.log" >&2; return 1; }
  export VERICACHE_S3_ENDPOINT="http://127.0.0.1:$port"
  # moto accepts any credentials; these are test dummies, set only when none are given.
  export AWS_ACCESS_KEY_ID="${AWS_ACCESS_KEY_ID:-testing}"
  export AWS_SECRET_ACCESS_KEY="${AWS_SECRET_ACCESS_KEY:-testing}"
  export AWS_DEFAULT_REGION="${AWS_DEFAULT_REGION:-us-east-1}"
}

vericache_stop_services() {
  local f pid
  for f in "$_vc_state/redis.pid" "$_vc_state/moto.pid"; do
    if [ -f "$f" ]; then
      pid="$(cat "$f")"
      [ -n "$pid" ] && kill "$pid" 2>/dev/null
      rm -f "$f"
    fi
  done
}

_vc_rc=0
if [ "${VERICACHE_SKIP_INSTALL:-0}" != 1 ]; then _vc_install || _vc_rc=1; fi
if [ $_vc_rc = 0 ]; then _vc_start_redis || _vc_rc=1; fi
if [ $_vc_rc = 0 ]; then _vc_start_moto || _vc_rc=1; fi
if [ -z "$(trap -p EXIT)" ]; then trap vericache_stop_services EXIT; fi
if [ $_vc_rc = 0 ]; then
  _vc_log "VERICACHE_REDIS_URL=$VERICACHE_REDIS_URL VERICACHE_S3_ENDPOINT=$VERICACHE_S3_ENDPOINT"
else
  _vc_log "services failed to start"
fi
# shellcheck disable=SC2317
return $_vc_rc 2>/dev/null || exit $_vc_rc
