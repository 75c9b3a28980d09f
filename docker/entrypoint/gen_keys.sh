#!/bin/sh
# gen_keys.sh KEYDIR [PORT]
#
# Creates, once, the ssh material that every node of a cluster shares, in KEYDIR:
#   id_ed25519, id_ed25519.pub  client key pair, generated HERE AT RUN TIME (mode 0600);
#                               never baked into an image, never committed
#   authorized_keys             the public key; start_sshd.sh's sshd_config points at it
#   known_hosts                 empty; start_sshd.sh appends each node's host key to it
#   ssh_config                  client config that uses only the files above (and PORT)
#   bin/ssh                     wrapper: `ssh -F KEYDIR/ssh_config "$@"`; put KEYDIR/bin first
#                               in PATH so that horovodrun's and mpirun's ssh calls use it
#                               and nothing is written to ~/.ssh
#
# Idempotent and safe to run concurrently from several nodes (flock on KEYDIR/.lock):
# the first caller generates, the others reuse.  Used by
#   - hvd_compress/tools/testing/cluster.py (emulated cluster of network namespaces), and
#   - docker/entrypoint/node.sh (docker compose nodes sharing a volume).
set -eu

die() { echo "gen_keys.sh: error: $*" >&2; exit 1; }

KEYDIR="${1:?usage: gen_keys.sh KEYDIR [PORT]}"
PORT="${2:-22}"
case "$KEYDIR" in /*) ;; *) die "KEYDIR must be an absolute path, got '$KEYDIR'" ;; esac
case "$PORT" in *[!0-9]*|'') die "PORT must be a number, got '$PORT'" ;; esac
command -v ssh-keygen >/dev/null 2>&1 || die "ssh-keygen not found (install openssh-client)"
SSH_BIN="$(command -v ssh 2>/dev/null)" || die "ssh not found (install openssh-client)"
command -v flock >/dev/null 2>&1 || die "flock not found (install util-linux)"

umask 077
mkdir -p "$KEYDIR"
chmod 0700 "$KEYDIR"

(
  flock 9
  if [ ! -s "$KEYDIR/id_ed25519" ]; then
    rm -f "$KEYDIR/id_ed25519" "$KEYDIR/id_ed25519.pub"
    ssh-keygen -q -t ed25519 -N '' -C "hvd_compress-cluster" -f "$KEYDIR/id_ed25519"
  fi
  chmod 0600 "$KEYDIR/id_ed25519"
  chmod 0644 "$KEYDIR/id_ed25519.pub"
  # StrictModes: authorized_keys must not be group/world writable.
  cp "$KEYDIR/id_ed25519.pub" "$KEYDIR/authorized_keys"
  chmod 0600 "$KEYDIR/authorized_keys"
  [ -e "$KEYDIR/known_hosts" ] || : > "$KEYDIR/known_hosts"
  chmod 0600 "$KEYDIR/known_hosts"

  cat > "$KEYDIR/ssh_config" <<EOF
# Written by docker/entrypoint/gen_keys.sh.  Uses only files in $KEYDIR.
Host *
    Port $PORT
    IdentityFile $KEYDIR/id_ed25519
    IdentitiesOnly yes
    UserKnownHostsFile $KEYDIR/known_hosts
    GlobalKnownHostsFile /dev/null
    StrictHostKeyChecking yes
    HashKnownHosts no
    PasswordAuthentication no
    KbdInteractiveAuthentication no
    BatchMode yes
    ConnectTimeout 10
    LogLevel ERROR
EOF
  chmod 0600 "$KEYDIR/ssh_config"

  mkdir -p "$KEYDIR/bin"
  chmod 0700 "$KEYDIR/bin"
  cat > "$KEYDIR/bin/ssh" <<EOF
#!/bin/sh
exec $SSH_BIN -F $KEYDIR/ssh_config "\$@"
EOF
  chmod 0700 "$KEYDIR/bin/ssh"
) 9>"$KEYDIR/.lock"
