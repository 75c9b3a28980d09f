#!/bin/sh
# start_sshd.sh --state DIR --keys KEYDIR --port PORT --name NAME [--alias ADDR]...
#               [--path PATH_FOR_SESSIONS] [--foreground]
#
# Starts a key-only sshd of our own (not the system's /etc/ssh/sshd_config):
#   - host key generated here at run time into DIR (never baked into an image),
#   - sshd_config written into DIR: PasswordAuthentication no, PermitRootLogin
#     prohibit-password, StrictModes yes, AuthorizedKeysFile KEYDIR/authorized_keys
#     (made by gen_keys.sh), listening on PORT,
#   - `SetEnv PATH=...` so that commands run over ssh (horovodrun's task and worker
#     launches, mpirun's orted) find the project's virtualenv and ssh wrapper,
#   - this node's host key appended to KEYDIR/known_hosts as "[NAME]:PORT,[ADDR]:PORT",
#     so clients using KEYDIR/ssh_config verify host keys strictly.
# Without --foreground sshd daemonizes (pid in DIR/sshd.pid) and this script returns
# once it listens; with --foreground it execs `sshd -D -e` (container main process).
#
# The very same script is run inside each network namespace by
# hvd_compress/tools/testing/cluster.py and as part of docker/entrypoint/node.sh.
set -eu

die() { echo "start_sshd.sh: error: $*" >&2; exit 1; }

STATE="" KEYS="" PORT="" NAME="" ALIASES="" SPATH="" FG=0
while [ $# -gt 0 ]; do
  case "$1" in
    --state) STATE="$2"; shift 2 ;;
    --keys) KEYS="$2"; shift 2 ;;
    --port) PORT="$2"; shift 2 ;;
    --name) NAME="$2"; shift 2 ;;
    --alias) ALIASES="$ALIASES $2"; shift 2 ;;
    --path) SPATH="$2"; shift 2 ;;
    --foreground) FG=1; shift ;;
    *) die "unknown argument '$1'" ;;
  esac
done
[ -n "$STATE" ] && [ -n "$KEYS" ] && [ -n "$PORT" ] && [ -n "$NAME" ] \
  || die "usage: start_sshd.sh --state DIR --keys KEYDIR --port PORT --name NAME [--alias ADDR]... [--path P] [--foreground]"
case "$STATE$KEYS" in *' '*) die "paths must not contain spaces" ;; esac
case "$STATE" in /*) ;; *) die "--state must be absolute" ;; esac
case "$KEYS" in /*) ;; *) die "--keys must be absolute" ;; esac
case "$PORT" in *[!0-9]*) die "--port must be a number" ;; esac
[ -s "$KEYS/authorized_keys" ] || die "$KEYS/authorized_keys missing: run gen_keys.sh $KEYS first"

SSHD="$(command -v sshd 2>/dev/null || true)"
[ -n "$SSHD" ] || { [ -x /usr/sbin/sshd ] && SSHD=/usr/sbin/sshd; } || die "sshd not found (install openssh-server)"
command -v ssh-keygen >/dev/null 2>&1 || die "ssh-keygen not found (install openssh-client)"

umask 077
mkdir -p "$STATE"
chmod 0700 "$STATE"
# sshd's privilege-separation directory (normally made by the openssh-server service).
[ -d /run/sshd ] || { mkdir -p /run/sshd && chmod 0755 /run/sshd; }

HOSTKEY="$STATE/ssh_host_ed25519_key"
if [ ! -s "$HOSTKEY" ]; then
  rm -f "$HOSTKEY" "$HOSTKEY.pub"
  ssh-keygen -q -t ed25519 -N '' -C "hostkey-$NAME" -f "$HOSTKEY"
fi

{
  echo "# Written by docker/entrypoint/start_sshd.sh for $NAME."
  echo "Port $PORT"
  echo "HostKey $HOSTKEY"
  echo "PidFile $STATE/sshd.pid"
  echo "AuthorizedKeysFile $KEYS/authorized_keys"
  echo "PubkeyAuthentication yes"
  echo "PasswordAuthentication no"
  echo "KbdInteractiveAuthentication no"
  echo "PermitEmptyPasswords no"
  echo "PermitRootLogin prohibit-password"
  echo "StrictModes yes"
  echo "UsePAM no"
  echo "PermitUserEnvironment no"
  echo "X11Forwarding no"
  echo "AllowAgentForwarding no"
  echo "PrintMotd no"
  echo "PrintLastLog no"
  echo "UseDNS no"
  echo "MaxStartups 100:30:200"
  echo "LogLevel ERROR"
  [ -z "$SPATH" ] || echo "SetEnv PATH=$SPATH"
} > "$STATE/sshd_config"

"$SSHD" -t -f "$STATE/sshd_config" || die "sshd rejected $STATE/sshd_config"

# Record our host key for clients (flock: several nodes may write at once).
names="[$NAME]:$PORT"
for a in $ALIASES; do names="$names,[$a]:$PORT"; done
pub="$(cut -d' ' -f1,2 "$HOSTKEY.pub")"
(
  flock 9
  touch "$KEYS/known_hosts"
  grep -v -F -e "[$NAME]:$PORT" "$KEYS/known_hosts" > "$KEYS/known_hosts.tmp" || true
  echo "$names $pub" >> "$KEYS/known_hosts.tmp"
  chmod 0600 "$KEYS/known_hosts.tmp"
  mv -f "$KEYS/known_hosts.tmp" "$KEYS/known_hosts"
) 9>>"$KEYS/.lock"

if [ "$FG" = 1 ]; then
  exec "$SSHD" -D -e -f "$STATE/sshd_config"
fi

rm -f "$STATE/sshd.pid"
"$SSHD" -f "$STATE/sshd_config" || die "sshd failed to start"
i=0
while [ ! -s "$STATE/sshd.pid" ]; do
  i=$((i + 1))
  [ "$i" -le 100 ] || die "sshd did not write $STATE/sshd.pid within 10 s"
  sleep 0.1
done
