#!/usr/bin/env bash
# A local single-member etcd for nonstop's control store (etcd://127.0.0.1:PORT).
#   scripts/etcd.sh [install]                             install etcd + etcdctl (apt) unless on PATH
#   scripts/etcd.sh start DATA_DIR PORT SECRET_FILE [PEER_PORT]
#       start etcd bound to 127.0.0.1:PORT (or $ETCD_HOST:PORT; peers on PEER_PORT, default a free port),
#       wait until it answers, make sure auth is on with user root and the password derived
#       from the job secret in SECRET_FILE (first line; the password is
#       hex(HMAC-SHA256(secret, "nonstop/v1/etcd")), nonstop.control.channel.etcd_password:
#       the secret itself never reaches etcd), then print its pid. Data, log and pid file live in DATA_DIR;
#       starting again on the same DATA_DIR keeps the data and checks the password.
#       TLS mode: with ETCD_TLS_DIR set, etcd serves clients over TLS only (etcds://HOST:PORT for
#       nonstop) with --client-cert-auth: that directory holds ca.pem (the CA clients must be signed
#       by, etcd's --trusted-ca-file), server.pem + server-key.pem (etcd's certificate: SANs for the
#       host clients use, e.g. IP:127.0.0.1; its CN must not name an etcd user, since etcd's JSON
#       gateway may act as that user for requests without a token) and client.pem + client-key.pem
#       (a client certificate this script uses to set up and check auth; any CN). The root user
#       and password are set up over TLS as above. Peers stay on plain HTTP, bound to the same host.
#       nonstop then needs --store etcds://HOST:PORT --etcd-ca ca.pem --etcd-cert C --etcd-key K.
#   scripts/etcd.sh stop DATA_DIR                         stop the etcd started on DATA_DIR
# Heartbeat 50 ms / election timeout 500 ms: etcd's minimum lease TTL is
# ceil(1.5 * election timeout) = 1 s (with etcd's defaults it is 2 s), so 1 s leases are honoured.
set -euo pipefail

die() { echo "etcd.sh: $*" >&2; exit 1; }

install_etcd() {
  command -v etcd >/dev/null && command -v etcdctl >/dev/null && return 0
  local sudo=()
  if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null || die "etcd is not installed and we are not root: install etcd >= 3.4 (Debian/Ubuntu: apt-get install etcd-server etcd-client) or put etcd and etcdctl on PATH"
    sudo=(sudo)
  fi
  command -v apt-get >/dev/null || die "etcd is not installed and apt-get is missing: install etcd >= 3.4 (etcd and etcdctl) and put it on PATH"
  local log
  log=$(mktemp)
  export DEBIAN_FRONTEND=noninteractive
  if ! "${sudo[@]}" apt-get install -y -qq etcd-server etcd-client >"$log" 2>&1; then
    "${sudo[@]}" apt-get update -qq >>"$log" 2>&1 || true
    if ! "${sudo[@]}" apt-get install -y -qq etcd-server etcd-client >>"$log" 2>&1; then
      tail -n 20 "$log" >&2
      rm -f "$log"
      die "could not install etcd-server and etcd-client with apt-get (output above)"
    fi
  fi
  rm -f "$log"
  # The Debian package enables a system-wide etcd service; nonstop starts its own.
  command -v etcd >/dev/null && command -v etcdctl >/dev/null || die "installed etcd but etcd/etcdctl are not on PATH"
}

# derive_password < SECRET_FILE: etcd's root password for the job (see the header).
derive_password() {
  python3 -c '
import hashlib, hmac, sys
secret = sys.stdin.readline().strip().encode()
if len(secret) < 16:
    sys.exit(1)
print(hmac.new(secret, b"nonstop/v1/etcd", hashlib.sha256).hexdigest())
'
}

free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# fail PID DIR MESSAGE: stop the etcd we started, then exit with MESSAGE.
fail() {
  kill "$1" 2>/dev/null || true
  rm -f "$2/etcd.pid"
  die "$3"
}

# wait_for PID DIR MESSAGE CMD...: run CMD every 0.1 s until it succeeds (10 s at most).
wait_for() {
  local pid=$1 dir=$2 message=$3
  shift 3
  for _ in $(seq 100); do
    "$@" >/dev/null 2>&1 && return 0
    if ! kill -0 "$pid" 2>/dev/null; then
      tail -n 20 "$dir/etcd.log" >&2
      rm -f "$dir/etcd.pid"
      die "etcd exited at start (log above, in $dir/etcd.log); is one of its ports in use?"
    fi
    sleep 0.1
  done
  fail "$pid" "$dir" "$message within 10 s (log: $dir/etcd.log)"
}

alive() { [ -f "$1/etcd.pid" ] && kill -0 "$(cat "$1/etcd.pid")" 2>/dev/null; }

start() {
  [ $# -ge 3 ] && [ $# -le 4 ] || die "usage: scripts/etcd.sh start DATA_DIR PORT SECRET_FILE [PEER_PORT]"
  local dir=$1 port=$2 secret_file=$3 peer=${4:-}
  [[ $port =~ ^[0-9]+$ ]] && [ "$port" -gt 0 ] && [ "$port" -lt 65536 ] || die "bad client port '$port'"
  [ -r "$secret_file" ] || die "secret file '$secret_file' is missing or unreadable"
  local password
  password=$(derive_password <"$secret_file") || die "secret file '$secret_file' is empty or shorter than 16 bytes"
  [ -n "$peer" ] || peer=$(free_port)
  [[ $peer =~ ^[0-9]+$ ]] && [ "$peer" != "$port" ] || die "bad peer port '$peer'"
  install_etcd
  mkdir -p "$dir"
  dir=$(cd "$dir" && pwd)
  alive "$dir" && die "an etcd (pid $(cat "$dir/etcd.pid")) is already running on $dir; stop it first"
  local fresh=1
  [ -d "$dir/data/member" ] && fresh=0
  local host=${ETCD_HOST:-127.0.0.1}  # where it binds: explicit, loopback unless told otherwise
  local client="http://$host:$port" peer_url="http://$host:$peer"
  local tls_args=() ctl_tls=()
  if [ -n "${ETCD_TLS_DIR:-}" ]; then
    local t=$ETCD_TLS_DIR f
    for f in ca.pem server.pem server-key.pem client.pem client-key.pem; do
      [ -r "$t/$f" ] || die "ETCD_TLS_DIR=$t has no readable $f (needs ca.pem, server.pem, server-key.pem, client.pem, client-key.pem)"
    done
    client="https://$host:$port"
    tls_args=(--cert-file "$t/server.pem" --key-file "$t/server-key.pem" --trusted-ca-file "$t/ca.pem" --client-cert-auth)
    ctl_tls=(--cacert "$t/ca.pem" --cert "$t/client.pem" --key "$t/client-key.pem")
  fi
  nohup etcd --name nonstop --data-dir "$dir/data" \
    --listen-client-urls "$client" --advertise-client-urls "$client" "${tls_args[@]}" \
    --listen-peer-urls "$peer_url" --initial-advertise-peer-urls "$peer_url" \
    --initial-cluster "nonstop=$peer_url" --initial-cluster-state new \
    --heartbeat-interval 50 --election-timeout 500 \
    --logger zap --log-outputs stderr --log-level warn \
    >"$dir/etcd.log" 2>&1 </dev/null &
  local pid=$!
  echo "$pid" >"$dir/etcd.pid"
  export ETCDCTL_API=3
  local ctl=(etcdctl --endpoints "$client" --dial-timeout 1s --command-timeout 2s "${ctl_tls[@]}")
  # Listening first (answers without credentials), then committing writes (has a leader).
  wait_for "$pid" "$dir" "etcd on $client did not start listening" "${ctl[@]}" endpoint status
  if [ "$fresh" = 1 ]; then
    wait_for "$pid" "$dir" "etcd on $client did not elect itself leader" "${ctl[@]}" endpoint health
    # The password goes through stdin and the environment, never the command line (ps).
    printf '%s\n' "$password" | "${ctl[@]}" user add root --interactive=false >/dev/null \
      || fail "$pid" "$dir" "could not create etcd user root"
    "${ctl[@]}" role add root >/dev/null || fail "$pid" "$dir" "could not create etcd role root"
    "${ctl[@]}" user grant-role root root >/dev/null || fail "$pid" "$dir" "could not grant etcd role root"
    "${ctl[@]}" auth enable >/dev/null || fail "$pid" "$dir" "could not enable etcd authentication"
  fi
  local out
  for _ in $(seq 50); do
    if out=$(ETCDCTL_USER="root:$password" "${ctl[@]}" endpoint health 2>&1); then
      echo "$pid"
      return 0
    fi
    case "$out" in
      *"authentication failed"*)
        fail "$pid" "$dir" "etcd on $dir does not accept the password in $secret_file for user root (data from another job?)" ;;
    esac
    kill -0 "$pid" 2>/dev/null || fail "$pid" "$dir" "etcd exited (log: $dir/etcd.log)"
    sleep 0.1
  done
  fail "$pid" "$dir" "etcd on $client is not healthy after 5 s: ${out##*$'\n'} (log: $dir/etcd.log)"
}

stop() {
  [ $# -eq 1 ] || die "usage: scripts/etcd.sh stop DATA_DIR"
  local dir=$1
  [ -f "$dir/etcd.pid" ] || { echo "etcd.sh: no etcd.pid in $dir; nothing to stop" >&2; return 0; }
  local pid
  pid=$(cat "$dir/etcd.pid")
  if kill -0 "$pid" 2>/dev/null; then
    kill "$pid"
    for _ in $(seq 50); do
      kill -0 "$pid" 2>/dev/null || break
      sleep 0.1
    done
    kill -0 "$pid" 2>/dev/null && kill -9 "$pid"
  fi
  rm -f "$dir/etcd.pid"
}

cmd=${1:-install}
[ $# -gt 0 ] && shift
case "$cmd" in
  install) install_etcd ;;
  start) start "$@" ;;
  stop) stop "$@" ;;
  *) die "unknown command '$cmd': use install, start DATA_DIR PORT SECRET_FILE [PEER_PORT], or stop DATA_DIR" ;;
esac
