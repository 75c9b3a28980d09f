"""Security of the multi-node set-up (docs/guide/security.md): no key material in the
repository or its history, keys generated at run time with 0600 permissions,
a key-only ssh client configuration.

Complements tests/test_docker_files.py (compose not privileged, no key at image
build time, build-context filters, sshd config is key-only) and
tests/testing/test_cluster.py (live cluster: key 0600 in a 0700 directory,
password login refused).
"""
import os
import re
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
GEN_KEYS = REPO / "docker" / "entrypoint" / "gen_keys.sh"
# Built from pieces so that this file does not match its own scan.
PEM = re.compile(b"-----" + b"BEGIN [A-Z0-9 ]*-----")
PRIVATE = re.compile(b"-----" + b"BEGIN [A-Z0-9 ]*PRIVATE" + b" KEY[A-Z ]*-----")
KEY_FILE_NAMES = re.compile(r"(^|/)(id_(rsa|dsa|ecdsa|ed25519)(\.pub)?|ssh_host_.*_key(\.pub)?|.*\.(pem|key|p12|pfx)"
                            r"|known_hosts|authorized_keys)$")


def _git(*args):
    return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, check=True).stdout


def _repo_files():
    """Every file of the repository: tracked, and untracked but not ignored (what a commit or
    `docker build .` would pick up).  No exclusions, no size limit, binaries included."""
    if not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    out = _git("ls-files", "-z", "--cached", "--others", "--exclude-standard")
    return [p for p in out.decode().split("\0") if p]


def test_no_pem_block_anywhere_in_the_repository():
    """No '-----BEGIN ...-----' block at all (private keys, certificates, public keys) in any file."""
    files = _repo_files()
    assert len(files) > 50
    hits = []
    for rel in files:
        p = REPO / rel
        if p.is_file():
            for m in PEM.finditer(p.read_bytes()):
                hits.append(f"{rel}: {m.group().decode(errors='replace')}")
    assert not hits, hits


def test_no_private_key_in_the_git_history():
    """Nor in any object ever committed (a key removed later would still be in the history)."""
    if not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    p = subprocess.run(["git", "-C", str(REPO), "cat-file", "--batch-all-objects", "--batch"],
                       capture_output=True, check=True)
    assert len(p.stdout) > 10_000
    assert not PRIVATE.search(p.stdout), PRIVATE.search(p.stdout).group()


def test_no_key_files_in_the_repository():
    named = [f for f in _repo_files() if KEY_FILE_NAMES.search(f)]
    assert not named, named


@pytest.mark.skipif(not shutil.which("ssh-keygen") or not shutil.which("flock"),
                    reason="ssh-keygen/flock (openssh-client, util-linux) not installed")
def test_keys_are_generated_at_run_time_with_0600(tmp_path):
    """docker/entrypoint/gen_keys.sh -- what the emulated cluster and the containers run: a fresh
    ed25519 key pair each time, private key 0600 in a 0700 directory, a client config that
    uses only that key, verifies host keys and never asks for a password."""
    keys = []
    for run in ("a", "b"):
        d = tmp_path / run / "ssh"
        r = subprocess.run(["sh", str(GEN_KEYS), str(d), "22022"], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        mode = lambda p: stat.S_IMODE(os.stat(p).st_mode)  # noqa: E731
        assert mode(d) == 0o700
        for name in ("id_ed25519", "authorized_keys", "known_hosts", "ssh_config"):
            assert mode(d / name) == 0o600, name
        assert PRIVATE.search((d / "id_ed25519").read_bytes())
        cfg = (d / "ssh_config").read_text()
        for line in ("IdentitiesOnly yes", "StrictHostKeyChecking yes", "PasswordAuthentication no",
                     "KbdInteractiveAuthentication no", "BatchMode yes", f"IdentityFile {d}/id_ed25519",
                     f"UserKnownHostsFile {d}/known_hosts", "GlobalKnownHostsFile /dev/null"):
            assert line in cfg, line
        assert (d / "authorized_keys").read_text() == (d / "id_ed25519.pub").read_text()
        keys.append((d / "id_ed25519.pub").read_text().split()[1])
        # idempotent: a second call (another node sharing the volume) keeps the key
        subprocess.run(["sh", str(GEN_KEYS), str(d), "22022"], check=True, capture_output=True, timeout=60)
        assert (d / "id_ed25519.pub").read_text().split()[1] == keys[-1]
    assert keys[0] != keys[1], "two set-ups got the same key: it is not generated at run time"


def test_gen_keys_refuses_relative_paths(tmp_path):
    r = subprocess.run(["sh", str(GEN_KEYS), "relative/dir"], capture_output=True, text=True, cwd=tmp_path,
                       timeout=30)
    assert r.returncode != 0 and "absolute" in r.stderr
