"""Simulated machines for multi-node tests and benches: network namespaces joined by real links.

    with Cluster(2, tmp_path) as c:                   # machines 0 and 1, each a network namespace
        c.start_s3()                                  # optional: moto on the storage network
        procs = c.torchrun(SCRIPT, ["save", ...], nproc=2)   # torchrun --nnodes 2 on every machine
        c.wait(procs, timeout=120)
        c.kill(1, wipe=True)                          # machine 1 dies and is replaced: memory gone
        c.cut(1) / c.heal(1) / c.slow(1, 10e6)        # its links down, up, or rate-limited (bytes/s)
        c.counters(0)                                 # bytes machine 0 sent and received on each network

Each machine is a network namespace with two interfaces, as in a training cluster: `eth0` on the
*fabric* (the machines' own traffic: torchrun's rendezvous, gloo's collectives and point-to-point
transfers) and `eth1` on the *storage network* (the S3-compatible server, on the host). The two
networks are Linux bridges on the host; their host-side veth ends carry per-interface byte counters,
so a test tells the bytes a machine sent to the other machines (fabric) from the bytes it sent to
storage. Each machine's processes run in a private mount and UTS namespace with its own hostname
(`node<k>`) and its own tmpfs-backed `/dev/shm` (a folder of the host's /dev/shm bind-mounted
there: what a machine keeps in shared memory survives its processes, as on a real machine, and is
lost when the machine is replaced: `kill(k, wipe=True)`). `scratch(k)` is the machine's local
disk, `shared` the parallel file system every machine mounts (a host folder).

Links: `cut` sets both of the machine's host-side ends down (no reset is sent: peers see silence,
as when a switch port or a cable fails); `slow` puts a token-bucket filter (tc tbf) on both ends,
each direction. This kernel has no netem (delay/loss), so a slow link is a rate limit only.

Teardown (`close`, also at exit) kills every process of every namespace, deletes the namespaces,
bridges and links and removes the folders: nothing is left behind (`leftovers()` checks).
Needs root, iproute2 and util-linux's unshare; `available()` says why not where it cannot run.
"""
from __future__ import annotations

import atexit
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from typing import Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def available() -> str | None:
    """None where simulated machines can be made here, else why not (a test skips with it)."""
    if os.geteuid() != 0:
        return "needs root (network and mount namespaces)"
    for tool in ("ip", "unshare", "tc"):
        if shutil.which(tool) is None:
            return f"needs {tool!r} (iproute2, util-linux)"
    probe = f"omkp{secrets.token_hex(3)}"
    try:
        r = _ip("netns", "add", probe, check=False)
        if r.returncode:
            return f"cannot create a network namespace: {r.stderr.strip()}"
        r = subprocess.run(["ip", "netns", "exec", probe, "unshare", "--mount", "--uts", "true"],
                           capture_output=True, text=True)
        if r.returncode:
            return f"cannot create a mount namespace: {r.stderr.strip()}"
    finally:
        _ip("netns", "del", probe, check=False)
    return None


class Cluster:
    """`n` simulated machines under `workdir` (see the module's docstring). Addresses: machine k is
    10.<a>.<b>.(k+1) on the fabric and 10.<a>.<b+1>.(k+1) on the storage network, the host .254
    on both; <a>.<b> is picked at random so that two clusters never share a subnet."""

    def __init__(self, n: int, workdir: str):
        self.n = n
        self.tag = f"om{secrets.token_hex(2)}"          # interface names stay under 15 characters
        net = secrets.randbelow(120) * 2
        self.fabric_net, self.storage_net = f"10.213.{net}", f"10.213.{net + 1}"
        self.workdir = os.path.abspath(workdir)
        self.shared = os.path.join(self.workdir, "shared")
        self._shm_root = f"/dev/shm/{self.tag}-cluster"   # each machine's memory: a folder of host RAM
        self._procs: list[subprocess.Popen] = []
        self._s3 = None
        self._up = False

    # ---------------------------------------------------------------- names
    def ns(self, k: int) -> str:
        return f"{self.tag}n{k}"

    def _veth(self, k: int, net: str) -> str:
        return f"{self.tag}{net}{k}"     # host side; "f" fabric, "s" storage

    def addr(self, k: int) -> str:
        """Machine k's fabric address (the rendezvous is machine 0's)."""
        return f"{self.fabric_net}.{k + 1}"

    @property
    def storage_host(self) -> str:
        """The host's address on the storage network (where start_s3's server listens)."""
        return f"{self.storage_net}.254"

    def shm(self, k: int) -> str:
        """Machine k's /dev/shm, seen from the host."""
        return os.path.join(self._shm_root, f"node{k}")

    def scratch(self, k: int) -> str:
        """Machine k's local disk, seen from the host and from the machine (the same path)."""
        return os.path.join(self.workdir, f"scratch{k}")

    # ---------------------------------------------------------------- set-up and teardown
    def __enter__(self) -> "Cluster":
        self.up()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def up(self) -> "Cluster":
        atexit.register(self.close)
        self._up = True
        os.makedirs(self.shared, exist_ok=True)
        for net, prefix in (("f", self.fabric_net), ("s", self.storage_net)):
            br = f"{self.tag}br{net}"
            _ip("link", "add", br, "type", "bridge")
            _ip("addr", "add", f"{prefix}.254/24", "dev", br)
            _ip("link", "set", br, "up")
        for k in range(self.n):
            _ip("netns", "add", self.ns(k))
            _ip("-n", self.ns(k), "link", "set", "lo", "up")
            for net, dev, prefix in (("f", "eth0", self.fabric_net), ("s", "eth1", self.storage_net)):
                host = self._veth(k, net)
                _ip("link", "add", host, "type", "veth", "peer", "name", dev, "netns", self.ns(k))
                _ip("link", "set", host, "master", f"{self.tag}br{net}", "up")
                _ip("-n", self.ns(k), "addr", "add", f"{prefix}.{k + 1}/24", "dev", dev)
                _ip("-n", self.ns(k), "link", "set", dev, "up")
            os.makedirs(self.shm(k), exist_ok=True)
            os.makedirs(self.scratch(k), exist_ok=True)
        return self

    def close(self) -> None:
        """Kill every process, remove namespaces, links, bridges, memory and folders. Idempotent."""
        if not self._up:
            return
        self._up = False
        for k in range(self.n):
            self._kill_ns(k)
        for p in self._procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        if self._s3 is not None:
            self._s3.stop()
            self._s3 = None
        for k in range(self.n):
            _ip("netns", "del", self.ns(k), check=False)   # takes the machine's veth ends with it
            for net in "fs":
                _ip("link", "del", self._veth(k, net), check=False)
        for net in "fs":
            _ip("link", "del", f"{self.tag}br{net}", check=False)
        shutil.rmtree(self._shm_root, ignore_errors=True)
        atexit.unregister(self.close)

    def leftovers(self) -> list[str]:
        """What of this cluster is still on the machine (empty after close())."""
        out = []
        netns = _ip("netns", "list", check=False).stdout
        links = _ip("-o", "link", "show", check=False).stdout
        out += [f"namespace {self.ns(k)}" for k in range(self.n) if self.ns(k) in netns]
        out += [f"link {line.split(':')[1].strip()}" for line in links.splitlines() if self.tag in line]
        if os.path.exists(self._shm_root):
            out.append(f"memory {self._shm_root}")
        out += [f"process {p.pid}" for p in self._procs if p.poll() is None]
        return out

    # ---------------------------------------------------------------- processes
    def env(self, k: int, extra: dict | None = None) -> dict:
        env = {key: v for key, v in os.environ.items() if not key.startswith(("OMNICKPT_", "MASTER_", "TORCHELASTIC"))}
        env.update(PYTHONPATH=os.pathsep.join([REPO, HERE]), GLOO_SOCKET_IFNAME="eth0", OMP_NUM_THREADS="1",
                   NODE_SCRATCH=self.scratch(k), NODE_SHARED=self.shared, NODE_INDEX=str(k),
                   PYTHONUNBUFFERED="1")
        if self._s3 is not None:
            from s3server import aws_env
            env.update(aws_env(self.s3_endpoint))
        env.update(extra or {})
        return env

    def popen(self, k: int, argv: Sequence[str], *, env: dict | None = None, log: str | None = None) -> subprocess.Popen:
        """Run `argv` on machine k: its network, its hostname, its /dev/shm. Output to `log`
        (default: <scratch>/<n>.log)."""
        inner = (f"hostname node{k} && mount --make-rprivate / && mount --bind {self.shm(k)} /dev/shm "
                 f"&& exec \"$@\"")
        cmd = ["ip", "netns", "exec", self.ns(k), "unshare", "--mount", "--uts", "sh", "-c", inner, "sh", *argv]
        log = log or os.path.join(self.scratch(k), f"proc{len(self._procs)}.log")
        with open(log, "ab") as f:
            p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=self.env(k, env), cwd=REPO,
                                 start_new_session=True)
        p.log = log
        self._procs.append(p)
        return p

    def torchrun(self, script: str, args: Sequence[str], *, nproc: int, machines: Sequence[int] | None = None,
                 env: dict | None = None, port: int = 29400) -> list[subprocess.Popen]:
        """torchrun --nnodes len(machines) --node-rank i on each of `machines` (default all), static
        rendezvous at the first one's fabric address: one Popen per machine."""
        machines = list(range(self.n)) if machines is None else list(machines)
        out = []
        for i, k in enumerate(machines):
            argv = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={len(machines)}", f"--node-rank={i}",
                    f"--nproc-per-node={nproc}", f"--master-addr={self.addr(machines[0])}",
                    f"--master-port={port}", "--max-restarts=0", "--monitor-interval=0.2", script, *args]
            out.append(self.popen(k, argv, env=env))
        return out

    def wait(self, procs: Sequence[subprocess.Popen], timeout: float) -> list[int]:
        """Return codes of `procs` once all ended; past `timeout` s kill them and raise with their logs."""
        deadline = time.monotonic() + timeout
        for p in procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                for q in procs:
                    if q.poll() is None:
                        os.killpg(q.pid, signal.SIGKILL)
                raise TimeoutError(f"machines did not finish within {timeout:.0f} s:\n" + self.logs(procs))
        return [p.returncode for p in procs]

    def logs(self, procs: Sequence[subprocess.Popen], tail: int = 6000) -> str:
        """Each log's last `tail` characters, then the start of any native crash report in it
        (faulthandler's) that the tail cut off: its first lines name the crashing thread, and come
        last so that a shortened CI log still shows them."""
        out = []
        for p in procs:
            with open(p.log, "rb") as f:
                text = f.read().decode(errors="replace")
            crash = text.find("Fatal Python error")
            head = (f"\n--- {p.log}: the start of its crash report ---\n" + text[crash:crash + 1500]
                    if 0 <= crash < len(text) - tail else "")
            out.append(f"--- {p.log} (rc {p.poll()}) ---\n" + text[-tail:] + head)
        return "\n".join(out)

    def _kill_ns(self, k: int) -> None:
        pids = _ip("netns", "pids", self.ns(k), check=False).stdout.split()
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        deadline = time.monotonic() + 10
        while _ip("netns", "pids", self.ns(k), check=False).stdout.split() and time.monotonic() < deadline:
            time.sleep(0.05)

    def kill(self, k: int, *, wipe: bool = False) -> None:
        """Machine k dies: every process on it is killed at once (SIGKILL: its sockets close, as
        when a machine's kernel goes). wipe=True: it is replaced by an empty one (its memory and
        local disk are gone)."""
        self._kill_ns(k)
        for p in self._procs:   # reap the launchers of that machine
            if p.poll() is None and p.args[3] == self.ns(k):
                p.wait(5)
        if wipe:
            for d in (self.shm(k), self.scratch(k)):
                shutil.rmtree(d, ignore_errors=True)
                os.makedirs(d)

    # ---------------------------------------------------------------- links
    def cut(self, k: int) -> None:
        """Machine k's links go down (fabric and storage): nothing arrives, nothing is reset."""
        for net in "fs":
            _ip("link", "set", self._veth(k, net), "down")

    def heal(self, k: int) -> None:
        """Machine k's links up again at full speed."""
        for net in "fs":
            _ip("link", "set", self._veth(k, net), "up")
            for dev, ns in ((self._veth(k, net), None), ("eth0" if net == "f" else "eth1", self.ns(k))):
                subprocess.run(["tc", *(["-n", ns] if ns else []), "qdisc", "del", "dev", dev, "root"],
                               capture_output=True)

    def slow(self, k: int, rate: float, nets: str = "fs") -> None:
        """Machine k's links (`nets`: "f" fabric, "s" storage) carry at most `rate` bytes/s each way
        (token bucket: tc tbf)."""
        bits = int(rate * 8)
        for net in nets:
            for dev, ns in ((self._veth(k, net), None), ("eth0" if net == "f" else "eth1", self.ns(k))):
                subprocess.run(["tc", *(["-n", ns] if ns else []), "qdisc", "replace", "dev", dev, "root", "tbf",
                                "rate", f"{bits}bit", "burst", "64kb", "latency", "400ms"], check=True,
                               capture_output=True)

    def counters(self, k: int) -> dict:
        """Bytes machine k sent and received so far: {"fabric": {"sent", "received"}, "storage": ...},
        read from the host ends of its links (what leaves the machine arrives at the host end)."""
        out = {}
        for net, name in (("f", "fabric"), ("s", "storage")):
            stats = f"/sys/class/net/{self._veth(k, net)}/statistics"
            with open(f"{stats}/rx_bytes") as rx, open(f"{stats}/tx_bytes") as tx:
                out[name] = {"sent": int(rx.read()), "received": int(tx.read())}
        return out

    # ---------------------------------------------------------------- storage
    def start_s3(self):
        """moto's S3 server on the host's storage-network address; machines get its endpoint in
        their environment (AWS_ENDPOINT_URL...)."""
        from s3server import MotoServer
        self._s3 = MotoServer(host=self.storage_host).start()
        return self._s3

    @property
    def s3_endpoint(self) -> str:
        return self._s3.endpoint


# ---------------------------------------------------------------------- talking to a running job
def signal_file(directory: str, name: str, payload: dict | None = None) -> None:
    """Write `name` in `directory` atomically (a job and the test wait for each other's files)."""
    tmp = os.path.join(directory, f".{name}.tmp")
    with open(tmp, "w") as f:
        json.dump(payload or {}, f)
    os.replace(tmp, os.path.join(directory, name))


def await_file(directory: str, name: str, timeout: float, procs: Sequence[subprocess.Popen] = ()) -> dict:
    """Wait for `name` in `directory`; raise when `timeout` passes or a process in `procs` ended."""
    path = os.path.join(directory, name)
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout:.0f} s")
        ended = [p for p in procs if p.poll() is not None]
        if ended:
            raise RuntimeError(f"{path}: a machine's job ended first (rc {[p.returncode for p in ended]})")
        time.sleep(0.05)
    with open(path) as f:
        return json.load(f)
