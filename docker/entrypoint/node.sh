#!/bin/sh
# Container entrypoint of docker/Dockerfile.cpu and docker/Dockerfile.cuda.
#
#   node.sh worker              sshd in the foreground (the container's main process)
#   node.sh launcher [CMD...]   sshd in the background, wait until every host in
#                               $HVDC_HOSTS answers over ssh, then exec CMD
#                               (e.g. horovodrun -H node1:1,node2:1 ...)
#   node.sh OTHER...            exec OTHER... unchanged (e.g. bash)
#
# Both roles first run gen_keys.sh (client key pair, generated at container start into
# the volume shared by all nodes: $HVDC_KEYS) and start_sshd.sh (host key generated at
# start, key-only sshd on $HVDC_SSH_PORT) -- the same two scripts that
# hvd_compress/tools/testing/cluster.py runs inside each network namespace of the emulated cluster.
#
# Environment: HVDC_KEYS (default /run/hvd_compress/ssh), HVDC_SSH_PORT (22022),
# HVDC_HOSTS (space-separated host names the launcher waits for), HVDC_WAIT_S (120),
# HVDC_VENV_BIN (/opt/hvd_compress/.venv/bin), HVDC_SSHD_STATE (/run/hvd_compress/sshd).
set -eu

HERE="$(cd "$(dirname "$0")" && pwd)"
KEYS="${HVDC_KEYS:-/run/hvd_compress/ssh}"
PORT="${HVDC_SSH_PORT:-22022}"
STATE="${HVDC_SSHD_STATE:-/run/hvd_compress/sshd}"
VENV_BIN="${HVDC_VENV_BIN:-/opt/hvd_compress/.venv/bin}"
WAIT_S="${HVDC_WAIT_S:-120}"
SYS_PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin

role="${1:-worker}"
[ $# -eq 0 ] || shift
case "$role" in
  worker|launcher) ;;
  *) exec "$role" "$@" ;;
esac

NAME="$(hostname)"
ADDR="$(hostname -i 2>/dev/null | awk '{print $1}')" || ADDR=""
sh "$HERE/gen_keys.sh" "$KEYS" "$PORT"
sshd_args="--state $STATE --keys $KEYS --port $PORT --name $NAME --path $KEYS/bin:$VENV_BIN:$SYS_PATH"
[ -z "$ADDR" ] || sshd_args="$sshd_args --alias $ADDR"

if [ "$role" = worker ]; then
  # shellcheck disable=SC2086  # word splitting of sshd_args is intended (no spaces in values)
  exec sh "$HERE/start_sshd.sh" $sshd_args --foreground
fi

# shellcheck disable=SC2086
sh "$HERE/start_sshd.sh" $sshd_args
export PATH="$KEYS/bin:$VENV_BIN:$PATH"
for h in ${HVDC_HOSTS:-}; do
  t=0
  until ssh -o ConnectTimeout=2 "$h" true 2>/dev/null; do
    t=$((t + 1))
    if [ "$t" -gt "$WAIT_S" ]; then
      echo "node.sh: error: $h did not answer over ssh on port $PORT within $WAIT_S s" >&2
      exit 1
    fi
    sleep 1
  done
  echo "node.sh: $h is up"
done
[ $# -gt 0 ] || set -- sleep infinity
exec "$@"
