"""Emulated multi-host cluster: N "hosts" as Linux network namespaces on one machine.

Each host ``PREFIX-hI`` is a network namespace with one interface ``eth0`` (a veth
pair) plugged into a bridge that lives in a namespace of its own (``PREFIX-br``), an
address in 198.18.0.0/15 (RFC 2544 benchmarking range), its own ``/etc/hosts``
(``/etc/netns/PREFIX-hI/hosts``, bind-mounted by ``ip netns exec``) that maps every
host name to its address, its own hostname (a UTS namespace), and a key-only sshd.
Optional ``tc tbf`` shaping limits every host's link in both directions.

The root namespace's addresses and routes are never touched: every interface is
created inside a namespace, and the bridge is not in the root namespace.

Commands run "on" a host with :meth:`Cluster.run`; ``horovodrun`` is launched from
inside host 1's namespace with :meth:`Cluster.horovodrun_args`, for example::

    from hvd_compress.tools.testing.cluster import Cluster
    with Cluster(2, rate_mbit=100) as c:
        r = c.run(0, c.horovodrun_command(["python", "train.py"], controller="gloo"),
                  timeout=300)

CLI (root only)::

    python -m hvd_compress.tools.testing.cluster up --hosts 3 [--rate 100mbit] [--name PREFIX]
    python -m hvd_compress.tools.testing.cluster status [--name PREFIX] [--json]
    python -m hvd_compress.tools.testing.cluster exec h1 [--name PREFIX] -- horovodrun ...
    python -m hvd_compress.tools.testing.cluster rate 1gbit|none [--name PREFIX]
    python -m hvd_compress.tools.testing.cluster down [--name PREFIX]

sshd is started by ``docker/entrypoint/start_sshd.sh`` and the keys are made by
``docker/entrypoint/gen_keys.sh``: the very scripts the docker images run.
"""
from __future__ import annotations

import argparse
import atexit
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Dict, List, NamedTuple, Optional, Sequence, Union

if __package__:
    from ..units import parse_rate
else:  # run by path as a script (the tests do so after dropping root): load the stdlib-only parsers by file
    import importlib.util as _ilu
    _spec = _ilu.spec_from_file_location("_hvdc_units", Path(__file__).resolve().parents[1] / "units.py")
    _units = _ilu.module_from_spec(_spec)
    _spec.loader.exec_module(_units)
    parse_rate = _units.parse_rate

__all__ = ["Cluster", "ClusterError", "LinkBytes", "teardown", "existing_clusters", "parse_rate"]

STATE_ROOT = Path(os.environ.get("HVDC_STATE_ROOT", "/run/hvd_compress"))
NETNS_ETC = Path("/etc/netns")
DEFAULT_PREFIX = "hvdc"
DEFAULT_SSH_PORT = 22022
SUBNET = "198.18.0"          # hosts get 198.18.0.11, .12, ... (/24 inside the bridge)
IFACE = "eth0"               # the hosts' interface name (same on every host, as in docker)
BRIDGE = "br0"
MAX_HOSTS = 32
_PREFIX_RE = re.compile(r"^[a-z][a-z0-9]{0,15}$")
_SYS_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_REPO = Path(__file__).resolve().parents[3]  # the checkout: hvd_compress/tools/testing/cluster.py
ENTRYPOINT_DIR = Path(os.environ.get("HVDC_ENTRYPOINT_DIR", _REPO / "docker" / "entrypoint"))


class ClusterError(RuntimeError):
    """A one-line, user-facing reason why the cluster cannot be created or used."""


class LinkBytes(NamedTuple):
    """Byte counters of a host's ``eth0`` (the host side of its veth pair)."""
    rx: int
    tx: int


# ----------------------------------------------------------------------------- helpers
def _which(name: str) -> Optional[str]:
    return shutil.which(name, path=os.environ.get("PATH", "") + ":" + _SYS_PATH)


def _cmd(argv: Sequence[str], check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
    try:
        p = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError as e:
        raise ClusterError(f"{argv[0]} not found: {e}") from None
    except subprocess.TimeoutExpired:
        raise ClusterError(f"`{shlex.join(argv)}` timed out after {timeout} s") from None
    if check and p.returncode != 0:
        msg = (p.stderr or p.stdout).strip().replace("\n", " | ")
        raise ClusterError(f"`{shlex.join(argv)}` failed (exit {p.returncode}): {msg}")
    return p


def _ip(*args: str, check: bool = True) -> str:
    return _cmd(["ip", *args], check=check).stdout


def _venv_bin() -> str:
    if sys.prefix != getattr(sys, "base_prefix", sys.prefix):
        return str(Path(sys.prefix) / "bin")
    return str(_REPO / ".venv" / "bin")


def _ns_regex(prefix: str) -> "re.Pattern[str]":
    return re.compile(rf"^{re.escape(prefix)}-(br|h[0-9]+)$")


def _list_netns() -> List[str]:
    out = _cmd(["ip", "netns", "list"], check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _our_namespaces(prefix: str) -> List[str]:
    rx = _ns_regex(prefix)
    return [n for n in _list_netns() if rx.match(n)]


def existing_clusters() -> List[str]:
    """Prefixes of clusters that have a state directory or namespaces on this machine."""
    found = set()
    if STATE_ROOT.is_dir():
        found.update(p.name for p in STATE_ROOT.iterdir() if (p / "state.json").exists())
    for n in _list_netns() if shutil.which("ip") else []:
        m = re.match(r"^([a-z][a-z0-9]{0,15})-(br|h[0-9]+)$", n)
        if m:
            found.add(m.group(1))
    return sorted(found)


def _preflight(need_tc: bool) -> None:
    """Refuse clearly, before creating anything, where this cannot work."""
    if not sys.platform.startswith("linux"):
        raise ClusterError("the emulated cluster needs Linux network namespaces")
    if os.geteuid() != 0:
        raise ClusterError("the emulated cluster needs root (CAP_SYS_ADMIN + CAP_NET_ADMIN for "
                           "`ip netns`); run as root, or use docker/compose.yaml instead")
    needed = {"ip": "iproute2", "unshare": "util-linux", "flock": "util-linux",
              "hostname": "hostname", "ssh": "openssh-client", "ssh-keygen": "openssh-client",
              "sshd": "openssh-server"}
    if need_tc:
        needed["tc"] = "iproute2"
    missing = [f"{tool} (Debian package {pkg})" for tool, pkg in needed.items() if not _which(tool)]
    if missing:
        raise ClusterError("missing for the emulated cluster: " + ", ".join(missing))
    p = _cmd(["ip", "netns", "list"], check=False)
    if p.returncode != 0:
        raise ClusterError(f"`ip netns` is not usable here: {p.stderr.strip()}")
    for script in ("gen_keys.sh", "start_sshd.sh"):
        if not (ENTRYPOINT_DIR / script).is_file():
            raise ClusterError(f"{ENTRYPOINT_DIR / script} not found (set HVDC_ENTRYPOINT_DIR)")


def _kill_namespace_processes(namespaces: Sequence[str]) -> None:
    def pids() -> List[int]:
        out: List[int] = []
        for ns in namespaces:
            p = _cmd(["ip", "netns", "pids", ns], check=False)
            out += [int(x) for x in p.stdout.split() if x.isdigit()]
        return [p for p in out if p > 1 and p != os.getpid()]

    for sig, wait in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 3.0)):
        victims = pids()
        if not victims:
            return
        for pid in victims:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and pids():
            time.sleep(0.05)


def teardown(prefix: str = DEFAULT_PREFIX) -> List[str]:
    """Remove everything a cluster named ``prefix`` created: processes inside its
    namespaces (sshd, stray ranks), the namespaces, ``/etc/netns/PREFIX-*`` and the
    state directory with its keys.  Idempotent; returns what was removed.  Raises
    ClusterError (after trying everything) if something could not be removed."""
    if not _PREFIX_RE.match(prefix):
        raise ClusterError(f"invalid cluster name {prefix!r}")
    removed: List[str] = []
    errors: List[str] = []
    namespaces = _our_namespaces(prefix) if shutil.which("ip") or _which("ip") else []
    try:
        _kill_namespace_processes(namespaces)
    except Exception as e:  # keep going: namespaces and files must still go
        errors.append(f"killing processes: {e}")
    for ns in namespaces:
        p = _cmd(["ip", "netns", "del", ns], check=False)
        if p.returncode == 0:
            removed.append(f"netns {ns}")
        else:
            errors.append(f"ip netns del {ns}: {p.stderr.strip()}")
    rx = _ns_regex(prefix)
    if NETNS_ETC.is_dir():
        for d in NETNS_ETC.iterdir():
            if rx.match(d.name):
                shutil.rmtree(d, ignore_errors=True)
                removed.append(str(d))
        try:
            NETNS_ETC.rmdir()  # only if empty
        except OSError:
            pass
    state = STATE_ROOT / prefix
    if state.exists():
        # sshd pid files: belt and braces for a daemon that escaped its namespace
        for pidfile in state.glob("h*/sshd.pid"):
            try:
                pid = int(pidfile.read_text().strip())
                if str(state) in Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " "):
                    os.kill(pid, signal.SIGKILL)
            except (OSError, ValueError):
                pass
        shutil.rmtree(state, ignore_errors=True)
        removed.append(str(state))
        if state.exists():
            errors.append(f"could not remove {state}")
    try:
        STATE_ROOT.rmdir()
    except OSError:
        pass
    if errors:
        raise ClusterError(f"cleanup of cluster '{prefix}' incomplete: " + "; ".join(errors))
    return removed


def _raise_system_exit(signum, frame):  # pragma: no cover - exercised in a subprocess test
    raise SystemExit(128 + signum)


# ----------------------------------------------------------------------------- Cluster
class Cluster:
    """N emulated hosts (network namespaces + veth + bridge + sshd); see module doc.

    Use as a context manager (``with Cluster(3) as c: ...``), which cleans up on exit,
    on exceptions and on SIGTERM/SIGHUP; or ``start()``/``close()``.

    Attributes: ``hosts`` (names, also the namespace names and hostnames), ``ips``,
    ``ssh_port``, ``ssh_key`` (private key path), ``iface`` ('eth0'), ``rate_mbit``,
    ``venv_bin`` (bin directory put on PATH for commands run over ssh).
    Host indices are 0-based positions in ``hosts`` (0 -> PREFIX-h1).
    """

    def __init__(self, n_hosts: int = 2, rate_mbit: Union[float, str, None] = None,
                 prefix: str = DEFAULT_PREFIX, ssh_port: int = DEFAULT_SSH_PORT,
                 venv_bin: Optional[str] = None):
        if not isinstance(n_hosts, int) or not 1 <= n_hosts <= MAX_HOSTS:
            raise ValueError(f"n_hosts must be an int in 1..{MAX_HOSTS}, got {n_hosts!r}")
        if not _PREFIX_RE.match(prefix):
            raise ValueError(f"prefix must match {_PREFIX_RE.pattern} (got {prefix!r})")
        if not 1024 < int(ssh_port) < 65536:
            raise ValueError(f"ssh_port must be a high port (1025..65535), got {ssh_port}")
        self.prefix = prefix
        self.n_hosts = n_hosts
        self.rate_mbit = parse_rate(rate_mbit)
        self.ssh_port = int(ssh_port)
        self.hosts = [f"{prefix}-h{i + 1}" for i in range(n_hosts)]
        self.ips = [f"{SUBNET}.{11 + i}" for i in range(n_hosts)]
        self.bridge_ns = f"{prefix}-br"
        self.iface = IFACE
        self.state_dir = STATE_ROOT / prefix
        self.key_dir = self.state_dir / "ssh"
        self.ssh_key = str(self.key_dir / "id_ed25519")
        self.venv_bin = venv_bin or _venv_bin()
        self._up = False
        self._owner = False
        self._saved_handlers: Dict[int, object] = {}

    # ------------------------------------------------------------------ lifecycle
    def __repr__(self) -> str:
        return (f"Cluster(n_hosts={self.n_hosts}, rate_mbit={self.rate_mbit}, prefix={self.prefix!r}, "
                f"up={self._up})")

    def __enter__(self) -> "Cluster":
        self._install_signal_handlers()
        try:
            self.start()
        except BaseException:
            self._restore_signal_handlers()
            raise
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.close()
        finally:
            self._restore_signal_handlers()

    @property
    def is_up(self) -> bool:
        return self._up

    def start(self, persist: bool = False) -> "Cluster":
        """Create the cluster.  Unless ``persist`` (the CLI's ``up``), it is also
        removed at interpreter exit if ``close()`` was not called."""
        if self._up:
            return self
        _preflight(need_tc=self.rate_mbit is not None)
        taken = _our_namespaces(self.prefix)
        if taken or self.state_dir.exists():
            what = ", ".join(taken) if taken else str(self.state_dir)
            raise ClusterError(f"cluster '{self.prefix}' already exists ({what}); remove it with "
                               f"`python -m hvd_compress.tools.testing.cluster down --name {self.prefix}` "
                               f"or pick another prefix")
        self._up = True
        self._owner = True
        if not persist:
            atexit.register(self.close)
        try:
            self._create()
        except BaseException as e:
            try:
                self.close()
            except ClusterError as ce:
                print(f"hvd_compress cluster: {ce}", file=sys.stderr)
            if isinstance(e, (ClusterError, KeyboardInterrupt, SystemExit)):
                raise
            raise ClusterError(f"bringing up cluster '{self.prefix}' failed: {e!r}") from e
        return self

    def close(self) -> None:
        """Tear everything down (idempotent)."""
        try:
            atexit.unregister(self.close)
        except Exception:
            pass
        if not self._up:
            return
        self._up = False
        # Finish the cleanup even if SIGTERM/SIGINT arrive meanwhile (delivered afterwards).
        block = {signal.SIGTERM, signal.SIGHUP, signal.SIGINT}
        main = threading.current_thread() is threading.main_thread()
        old = signal.pthread_sigmask(signal.SIG_BLOCK, block) if main else None
        try:
            teardown(self.prefix)
        finally:
            if old is not None:
                signal.pthread_sigmask(signal.SIG_SETMASK, old)

    def _install_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGTERM, signal.SIGHUP):
            try:
                if signal.getsignal(sig) in (signal.SIG_DFL, None):
                    self._saved_handlers[sig] = signal.signal(sig, _raise_system_exit)
            except (ValueError, OSError):
                pass

    def _restore_signal_handlers(self) -> None:
        for sig, old in self._saved_handlers.items():
            try:
                signal.signal(sig, old)
            except (ValueError, OSError, TypeError):
                pass
        self._saved_handlers.clear()

    # ------------------------------------------------------------------ creation
    def _state(self) -> dict:
        return {"prefix": self.prefix, "n_hosts": self.n_hosts, "hosts": self.hosts, "ips": self.ips,
                "ssh_port": self.ssh_port, "ssh_key": self.ssh_key, "iface": self.iface,
                "bridge_ns": self.bridge_ns, "rate_mbit": self.rate_mbit, "venv_bin": self.venv_bin}

    def _write_state(self) -> None:
        tmp = self.state_dir / "state.json.tmp"
        tmp.write_text(json.dumps(self._state(), indent=1))
        tmp.replace(self.state_dir / "state.json")

    @classmethod
    def attach(cls, prefix: str = DEFAULT_PREFIX) -> "Cluster":
        """A handle on a running cluster made by ``up`` (does not own it: close() on the
        handle still tears it down, as ``down`` does)."""
        path = STATE_ROOT / prefix / "state.json"
        try:
            st = json.loads(path.read_text())
        except (OSError, ValueError):
            raise ClusterError(f"no cluster named '{prefix}' ({path} not found); "
                               f"create one with `python -m hvd_compress.tools.testing.cluster up`") from None
        c = cls(st["n_hosts"], st["rate_mbit"], prefix, st["ssh_port"], st.get("venv_bin"))
        c._up = True
        return c

    def _sshd_path(self) -> str:
        return f"{self.key_dir}/bin:{self.venv_bin}:{_SYS_PATH}"

    def _create(self) -> None:
        STATE_ROOT.mkdir(mode=0o755, parents=True, exist_ok=True)
        self.state_dir.mkdir(mode=0o700)
        self._write_state()
        br = self.bridge_ns
        no_v6 = ("for f in all default; do echo 1 > /proc/sys/net/ipv6/conf/$f/disable_ipv6; done "
                 "2>/dev/null; true")
        _ip("netns", "add", br)
        _cmd(["ip", "netns", "exec", br, "sh", "-c", no_v6], check=False)
        _ip("-n", br, "link", "set", "lo", "up")
        _ip("-n", br, "link", "add", BRIDGE, "type", "bridge")
        _ip("-n", br, "link", "set", BRIDGE, "up")
        hosts_file = ("127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n"
                      + "".join(f"{ip}\t{name}\n" for name, ip in zip(self.hosts, self.ips)))
        for i, (name, ip) in enumerate(zip(self.hosts, self.ips)):
            _ip("netns", "add", name)
            _cmd(["ip", "netns", "exec", name, "sh", "-c", no_v6], check=False)
            etc = NETNS_ETC / name
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(hosts_file)
            peer = f"veth-h{i + 1}"
            _ip("-n", br, "link", "add", peer, "type", "veth", "peer", "name", IFACE, "netns", name)
            _ip("-n", br, "link", "set", peer, "master", BRIDGE)
            _ip("-n", br, "link", "set", peer, "up")
            _ip("-n", name, "link", "set", "lo", "up")
            _ip("-n", name, "addr", "add", f"{ip}/24", "dev", IFACE)
            _ip("-n", name, "link", "set", IFACE, "up")
        _cmd(["sh", str(ENTRYPOINT_DIR / "gen_keys.sh"), str(self.key_dir), str(self.ssh_port)])
        for i, (name, ip) in enumerate(zip(self.hosts, self.ips)):
            _cmd(self._ns_argv(i, ["sh", str(ENTRYPOINT_DIR / "start_sshd.sh"),
                                   "--state", str(self.state_dir / f"h{i + 1}"),
                                   "--keys", str(self.key_dir), "--port", str(self.ssh_port),
                                   "--name", name, "--alias", ip, "--path", self._sshd_path()]),
                 timeout=30)
        if self.rate_mbit is not None:
            self.set_rate(self.rate_mbit)
        self._wait_for_ssh()

    def _wait_for_ssh(self, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        pending = list(self.hosts)
        last = ""
        while pending:
            host = pending[0]
            r = self.run(0, ["ssh", "-o", "ConnectTimeout=3", host, "hostname"], timeout=15)
            if r.returncode == 0 and r.stdout.strip() == host:
                pending.pop(0)
                continue
            last = (r.stderr or r.stdout).strip().replace("\n", " | ")
            if time.monotonic() > deadline:
                raise ClusterError(f"ssh from {self.hosts[0]} to {host} does not work: {last}")
            time.sleep(0.2)

    # ------------------------------------------------------------------ running things
    def _index(self, host: Union[int, str]) -> int:
        if isinstance(host, int):
            if not 0 <= host < self.n_hosts:
                raise IndexError(f"host index {host} out of range 0..{self.n_hosts - 1}")
            return host
        for cand in (host, f"{self.prefix}-{host}"):
            if cand in self.hosts:
                return self.hosts.index(cand)
        raise KeyError(f"unknown host {host!r} (hosts: {', '.join(self.hosts)})")

    def _ns_argv(self, host: Union[int, str], argv: Sequence[str]) -> List[str]:
        name = self.hosts[self._index(host)]
        # ip netns exec: network namespace + /etc/netns/NAME/hosts bind-mounted on /etc/hosts;
        # unshare --uts: the host's own hostname, without touching the machine's.
        return ["ip", "netns", "exec", name, "unshare", "--uts", "--",
                "sh", "-c", 'hostname "$0" && exec "$@"', name, *argv]

    def env(self, extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
        """Environment for commands run on a host: os.environ with PATH starting with the
        cluster's ssh wrapper (so ssh uses only the cluster's key, config and known_hosts,
        never ~/.ssh) and the virtualenv's bin, and OMPI_MCA_oob_tcp_if_include=eth0.
        horovodrun forwards it to every rank
        (Gloo: inline ``env`` on the ssh command line; MPI: ``mpirun -x``)."""
        env = dict(os.environ)
        path = [p for p in env.get("PATH", _SYS_PATH).split(":")
                if p and p not in (str(self.key_dir / "bin"), self.venv_bin)]
        env["PATH"] = ":".join([str(self.key_dir / "bin"), self.venv_bin] + path)
        # horovodrun --mpi passes btl_tcp_if_include=eth0 itself; keep Open MPI's
        # out-of-band (launch/control) traffic on the hosts' link too.
        env.setdefault("OMPI_MCA_oob_tcp_if_include", self.iface)
        if extra:
            env.update({k: str(v) for k, v in extra.items()})
        return env

    def popen(self, host: Union[int, str], cmd: Union[str, Sequence[str]],
              env: Optional[Dict[str, str]] = None, **kwargs) -> subprocess.Popen:
        """Start ``cmd`` (argv list, or a string for ``sh -c``) on ``host`` in its own session."""
        argv = ["sh", "-c", cmd] if isinstance(cmd, str) else list(cmd)
        kwargs.setdefault("start_new_session", True)
        return subprocess.Popen(self._ns_argv(host, argv), env=self.env(env), **kwargs)

    def run(self, host_index: Union[int, str], cmd: Union[str, Sequence[str]],
            env: Optional[Dict[str, str]] = None, timeout: Optional[float] = None,
            check: bool = False, cwd: Optional[str] = None) -> subprocess.CompletedProcess:
        """Run ``cmd`` inside ``host_index``'s namespace (0-based index or host name) and
        return a CompletedProcess with text stdout/stderr.  On timeout the whole process
        group is killed and subprocess.TimeoutExpired raised."""
        if not self._up:
            raise ClusterError(f"cluster '{self.prefix}' is not up")
        p = self.popen(host_index, cmd, env=env, cwd=cwd, stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _killpg(p)
            out, err = p.communicate()
            raise subprocess.TimeoutExpired(p.args, timeout, out, err) from None
        except BaseException:
            _killpg(p)
            p.communicate()
            raise
        r = subprocess.CompletedProcess(p.args, p.returncode, out, err)
        if check:
            r.check_returncode()
        return r

    # ------------------------------------------------------------------ horovodrun
    def horovodrun_args(self, slots: int = 1, n_hosts: Optional[int] = None) -> List[str]:
        """Arguments that make horovodrun (run from host 1, see run()) use these hosts:
        ``-H h1:S,h2:S,... -p PORT --ssh-identity-file KEY --network-interface eth0
        --disable-cache`` (--disable-cache: nothing written to ~/.horovod)."""
        hosts = self.hosts[: n_hosts or self.n_hosts]
        return ["-H", ",".join(f"{h}:{slots}" for h in hosts), "-p", str(self.ssh_port),
                "--ssh-identity-file", self.ssh_key, "--network-interface", self.iface,
                "--disable-cache"]

    def horovodrun_command(self, command: Sequence[str], np: Optional[int] = None,
                           controller: Optional[str] = None, slots: int = 1,
                           extra: Sequence[str] = ()) -> List[str]:
        """Full horovodrun argv: ``[venv/bin/horovodrun, -np N, <horovodrun_args>,
        --gloo|--mpi, *extra, *command]``; pass it to ``run(0, ...)``."""
        n = np or self.n_hosts * slots
        argv = [str(Path(self.venv_bin) / "horovodrun"), "-np", str(n),
                *self.horovodrun_args(slots=slots, n_hosts=-(-n // slots))]
        if controller:
            if controller not in ("gloo", "mpi"):
                raise ValueError(f"controller must be 'gloo' or 'mpi', got {controller!r}")
            argv.append(f"--{controller}")
        return argv + list(extra) + list(command)

    # ------------------------------------------------------------------ links
    def link_bytes(self) -> Dict[str, LinkBytes]:
        """{host name: LinkBytes(rx, tx)} of each host's eth0 (its veth end)."""
        out: Dict[str, LinkBytes] = {}
        for name in self.hosts:
            info = json.loads(_ip("-n", name, "-j", "-s", "link", "show", "dev", self.iface))[0]
            st = info.get("stats64") or info["stats"]
            out[name] = LinkBytes(int(st["rx"]["bytes"]), int(st["tx"]["bytes"]))
        return out

    def set_rate(self, mbit: Union[float, str, None]) -> None:
        """Shape every host's link to ``mbit`` Mbit/s in both directions with ``tc tbf``
        (host eth0 egress and the bridge-side veth egress); None removes shaping."""
        rate = parse_rate(mbit)
        if rate is not None and not _which("tc"):
            raise ClusterError("tc not found (Debian package iproute2); cannot shape links")
        for i, name in enumerate(self.hosts):
            for ns, dev in ((name, self.iface), (self.bridge_ns, f"veth-h{i + 1}")):
                if rate is None:
                    p = _cmd(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], check=False)
                    if p.returncode != 0 and "No such file" not in p.stderr \
                            and "Cannot delete qdisc with handle of zero" not in p.stderr:
                        raise ClusterError(f"tc qdisc del on {ns}/{dev}: {p.stderr.strip()}")
                else:
                    bytes_per_s = rate * 1e6 / 8
                    burst = max(32 * 1024, int(bytes_per_s * 0.004))   # >= 4 ms of traffic
                    _cmd(["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf",
                          "rate", f"{rate:g}mbit", "burst", str(burst), "latency", "50ms"])
        self.rate_mbit = rate
        if self.state_dir.exists():
            self._write_state()

    def measure_throughput_mbit(self, src: int = 1, dst: int = 0, seconds: float = 2.0,
                                port: int = 5201) -> float:
        """Send TCP traffic from host ``src`` to host ``dst`` for ``seconds`` with a plain
        Python socket pair (no iperf) and return the goodput seen by the receiver, Mbit/s."""
        recv_py = ("import socket,time,json,sys\n"
                   "s=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1)\n"
                   f"s.bind(('0.0.0.0',{port}));s.listen(1);print('ready',flush=True)\n"
                   "c,_=s.accept();n=0;t0=None;buf=bytearray(1<<20)\n"
                   "while True:\n"
                   "  k=c.recv_into(buf)\n"
                   "  if not k: break\n"
                   "  if t0 is None: t0=time.perf_counter()\n"
                   "  n+=k\n"
                   "print(json.dumps({'bytes':n,'s':time.perf_counter()-(t0 or time.perf_counter())}))\n")
        send_py = ("import socket,time,sys\n"
                   f"c=socket.create_connection(('{self.ips[dst]}',{port}),timeout=10)\n"
                   "b=b'x'*(1<<16);t=time.perf_counter()\n"
                   f"while time.perf_counter()-t<{float(seconds)}: c.sendall(b)\n"
                   "c.shutdown(socket.SHUT_WR);c.recv(1);c.close()\n")
        py = str(Path(self.venv_bin) / "python") if (Path(self.venv_bin) / "python").exists() \
            else sys.executable
        rp = self.popen(dst, [py, "-c", recv_py], stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE, text=True)
        try:
            if rp.stdout.readline().strip() != "ready":
                raise ClusterError(f"throughput receiver failed: {rp.stderr.read()}")
            self.run(src, [py, "-c", send_py], timeout=seconds + 30, check=True)
            out, err = rp.communicate(timeout=30)
        finally:
            if rp.poll() is None:
                _killpg(rp)
                rp.communicate()
        res = json.loads(out.strip().splitlines()[-1])
        return res["bytes"] * 8 / max(res["s"], 1e-9) / 1e6

    # ------------------------------------------------------------------ status
    def status(self) -> dict:
        st = self._state()
        present = set(_list_netns())
        st["namespaces"] = {n: n in present for n in [*self.hosts, self.bridge_ns]}
        sshd = {}
        for i, name in enumerate(self.hosts):
            pidfile = self.state_dir / f"h{i + 1}" / "sshd.pid"
            try:
                pid = int(pidfile.read_text().strip())
                os.kill(pid, 0)
                sshd[name] = pid
            except (OSError, ValueError):
                sshd[name] = None
        st["sshd_pids"] = sshd
        if all(st["namespaces"].values()):
            st["link_bytes"] = {k: v._asdict() for k, v in self.link_bytes().items()}
        return st


def _killpg(p: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 3.0)):
        try:
            os.killpg(p.pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        try:
            p.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


# ----------------------------------------------------------------------------- CLI
def _main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hvd_compress.tools.testing.cluster",
                                 description="Emulated multi-host cluster of network namespaces (root only).")
    sub = ap.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="create the cluster and leave it running")
    up.add_argument("--hosts", type=int, default=2)
    up.add_argument("--rate", default=None, help="link rate, e.g. 100mbit, 1gbit (default: unshaped)")
    up.add_argument("--port", type=int, default=DEFAULT_SSH_PORT, help="sshd port on every host")
    for name, hlp in (("down", "remove the cluster and everything it made"),
                      ("status", "show the cluster"), ("rate", "change link shaping"),
                      ("exec", "run a command on a host: exec HOST -- CMD...")):
        p = sub.add_parser(name, help=hlp)
        if name == "status":
            p.add_argument("--json", action="store_true")
        if name == "rate":
            p.add_argument("rate", help="e.g. 100mbit, 1gbit, none")
        if name == "exec":
            p.add_argument("host", help="host name: PREFIX-h1 or h1")
            p.add_argument("command", nargs="*", help="after --")
    for p in sub.choices.values():
        p.add_argument("--name", default=DEFAULT_PREFIX, help=f"cluster prefix (default {DEFAULT_PREFIX})")
    argv = list(sys.argv[1:] if argv is None else argv)
    tail: List[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, tail = argv[:cut], argv[cut + 1:]
    args = ap.parse_args(argv)
    try:
        if args.cmd == "up":
            c = Cluster(args.hosts, parse_rate(args.rate), args.name, args.port).start(persist=True)
            print(f"cluster '{c.prefix}' up: " + ", ".join(f"{h}={ip}" for h, ip in zip(c.hosts, c.ips))
                  + f"; rate: {c.rate_mbit or 'unshaped'} Mbit/s")
            print("run horovodrun from host 1, e.g.:\n  python -m hvd_compress.tools.testing.cluster exec "
                  f"h1 --name {c.prefix} -- " + shlex.join(c.horovodrun_command(["python", "script.py"],
                                                                              controller="gloo")))
            print(f"remove with: python -m hvd_compress.tools.testing.cluster down --name {c.prefix}")
            return 0
        if args.cmd == "down":
            removed = teardown(args.name)
            print(f"cluster '{args.name}': " + (f"removed {len(removed)} item(s)" if removed else "nothing to remove"))
            return 0
        c = Cluster.attach(args.name)
        if args.cmd == "status":
            st = c.status()
            if args.json:
                print(json.dumps(st, indent=1))
            else:
                for i, h in enumerate(c.hosts):
                    lb = st.get("link_bytes", {}).get(h, {})
                    print(f"{h}\t{c.ips[i]}\tnetns={'yes' if st['namespaces'][h] else 'MISSING'}\t"
                          f"sshd={st['sshd_pids'][h] or 'DOWN'}\trx={lb.get('rx')}\ttx={lb.get('tx')}")
                print(f"rate: {c.rate_mbit or 'unshaped'} Mbit/s; ssh port {c.ssh_port}; key {c.ssh_key}")
                print("horovodrun args: " + shlex.join(c.horovodrun_args()))
            return 0
        if args.cmd == "rate":
            c.set_rate(args.rate)
            print(f"cluster '{c.prefix}': rate {c.rate_mbit or 'unshaped'} Mbit/s")
            return 0
        if args.cmd == "exec":
            cmd = args.command + tail
            if not cmd:
                raise ClusterError("exec needs a command: exec HOST -- CMD...")
            return subprocess.call(c._ns_argv(args.host, cmd), env=c.env())
    except (ClusterError, ValueError, KeyError, IndexError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"{ap.prog}: error: {msg}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(_main())
