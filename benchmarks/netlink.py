"""Two emulated machines joined by a shaped link: network namespaces, one veth pair (or a tun relay), ``tc``.

    with EmulatedLink() as link:                    # refuses (LinkUnavailable) unless root with ip + tc + netns
        link.shape(rate_gbit=1)                     # both directions: tbf rate (+ netem delay / loss if present)
        procs = [link.popen(i, [sys.executable, "train.py"], env=link.machine_env(i)) for i in (0, 1)]
        link.outage(True); ...; link.outage(False)  # every packet dropped (a pfifo of limit 0), then restored
    with EmulatedLink(wire="relay", loss_pct=1.0, delay_ms=5):  # loss and delay without netem (tun_relay.py)
        ...
    # both namespaces (and the veth with them) are gone here, also on an exception or Ctrl-C

Layout (machine i = namespace ``<prefix>-m<i>``)::

    namespace afs-<pid>-m0                       namespace afs-<pid>-m1
      lo (up)                                      lo (up)
      v0 10.231.<k>.1/24  <=== veth pair ===>     v1 10.231.<k>.2/24
      egress qdisc: [netem] -> tbf                 egress qdisc: [netem] -> tbf

Processes of one machine reach each other over that namespace's ``lo`` (unshaped, as ranks of one host do over
shared memory or loopback); only traffic between the machines crosses the veth, and ``tbf`` shapes egress, so
each end is shaped for its direction.  Every address lives on an interface created here inside a namespace created
here: nothing touches the host's interfaces or routes.

Wire ``relay`` (for kernels without netem, which cannot drop or delay packets with tc): each namespace has a tun
device ``t0`` / ``t1`` instead (same addresses, MTU 9000, tbf usable on it), and two ``tun_relay.py`` processes,
one per namespace, move the packets between them in userspace, dropping each with probability ``loss_pct`` / 100,
holding each ``delay_ms`` (one way) and dropping everything during an :meth:`EmulatedLink.outage`.  About 2 Gbit/s
unshaped on one core (veth: ~15).

Cleanup: the relays are killed and the namespaces deleted on ``__exit__``, at interpreter exit (``atexit``) and on
SIGINT/SIGTERM (the handler deletes them, then raises ``KeyboardInterrupt`` / exits); a relay whose parent died
ends by itself (its control socket closes).  A namespace left by a process that was killed
with SIGKILL carries its pid in its name: :func:`remove_stale` (run by every new link) deletes those of dead pids.
"""
from __future__ import annotations

import atexit
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from typing import Dict, List, Optional, Sequence

PREFIX = "afs"  # every namespace this module makes is named afs-<pid>-m<i>
WIRES = ("veth", "relay")
RELAY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tun_relay.py")
NO_NETEM = ("this kernel has no netem qdisc (tc cannot delay or drop packets): "
            "EmulatedLink(wire=\"relay\", loss_pct=..., delay_ms=...) makes loss and delay in userspace")


class LinkUnavailable(RuntimeError):
    """This host cannot emulate the link (not root, no ip/tc, namespaces refused): the message says what to do."""


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(list(argv), capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise RuntimeError(f"`{' '.join(argv)}` failed ({done.returncode}): {done.stderr.strip() or done.stdout}")
    return done


def namespaces() -> List[str]:
    """Names of every network namespace on the host (``ip netns list``)."""
    if shutil.which("ip") is None:
        return []
    out = _run("ip", "netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def ours() -> List[str]:
    """The namespaces this module made (any process)."""
    return [ns for ns in namespaces() if ns.startswith(PREFIX + "-")]


def remove_stale() -> List[str]:
    """Delete namespaces of this module whose process is gone (a run killed with SIGKILL); returns their names."""
    removed = []
    for ns in ours():
        try:
            pid = int(ns.split("-")[1])
        except (IndexError, ValueError):
            continue
        if not os.path.exists(f"/proc/{pid}"):
            _run("ip", "netns", "del", ns, check=False)
            removed.append(ns)
    return removed


def check_available() -> None:
    """Raise :class:`LinkUnavailable` naming what is missing."""
    if os.geteuid() != 0:
        raise LinkUnavailable("the link emulation needs root (network namespaces, veth, tc): run it as root, e.g. in "
                              "CI or `sudo -E make bench-link`")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise LinkUnavailable(f"`{tool}` is not installed: install iproute2 (apt-get install iproute2)")


class EmulatedLink:
    """Two namespaces ``names[0]``, ``names[1]`` joined by a veth pair ``v0`` / ``v1``; see the module docstring."""

    def __init__(self, subnet_octet: Optional[int] = None, wire: str = "veth", loss_pct: float = 0.0,
                 delay_ms: float = 0.0, mtu: Optional[int] = None, seed: int = 0) -> None:
        if wire not in WIRES:
            raise ValueError(f"wire={wire!r}: one of {WIRES}")
        check_available()
        remove_stale()
        pid = os.getpid()
        self.wire = wire
        self.names = [f"{PREFIX}-{pid}-m0", f"{PREFIX}-{pid}-m1"]
        self.devices = ["v0", "v1"] if wire == "veth" else ["t0", "t1"]
        # a private /24 per process (10.231.0.0/16 is used only inside these namespaces), so two links coexist
        k = subnet_octet if subnet_octet is not None else 1 + pid % 250
        self.addresses = [f"10.231.{k}.1", f"10.231.{k}.2"]
        self.made: List[str] = []
        self._previous_handlers: Dict[int, object] = {}
        self.shaping: Dict[str, float] = {}
        # relay wire: 9000 bytes per packet (a jumbo frame) keeps the userspace relay's packet rate low
        self.mtu = mtu or (9000 if wire == "relay" else None)
        self.seed = seed
        self.relays: List[subprocess.Popen] = []
        self._controls: List[socket.socket] = []
        self._initial_faults = (loss_pct, delay_ms)
        self._down = False

    # ------------------------------------------------------------------ set up and tear down
    def __enter__(self) -> "EmulatedLink":
        atexit.register(self.close)
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous_handlers[sig] = signal.signal(sig, self._on_signal)
        try:
            for ns in self.names:
                done = _run("ip", "netns", "add", ns, check=False)
                if done.returncode != 0:
                    raise LinkUnavailable(f"cannot create network namespace {ns}: {done.stderr.strip()} (a container "
                                          "without CAP_SYS_ADMIN refuses namespaces: run on a host or a privileged "
                                          "container)")
                self.made.append(ns)
            if self.wire == "veth":
                _run("ip", "link", "add", "v0", "netns", self.names[0], "type", "veth", "peer", "name", "v1",
                     "netns", self.names[1])
            else:
                for ns, dev in zip(self.names, self.devices):
                    self.ns_run(ns, "ip", "tuntap", "add", "dev", dev, "mode", "tun")
            for ns, dev, addr in zip(self.names, self.devices, self.addresses):
                self.ns_run(ns, "ip", "addr", "add", f"{addr}/24", "dev", dev)
                if self.mtu:
                    self.ns_run(ns, "ip", "link", "set", dev, "mtu", str(self.mtu))
                self.ns_run(ns, "ip", "link", "set", dev, "up")
                self.ns_run(ns, "ip", "link", "set", "lo", "up")
            if self.wire == "relay":
                self._start_relays()
                if any(self._initial_faults):
                    self.shape(None, delay_ms=self._initial_faults[1], loss_pct=self._initial_faults[0])
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Stop the relays, then delete the namespaces (the veth or tun devices go with them); idempotent."""
        for control in self._controls:
            control.close()  # (a relay ends at the end of its control stream; killed anyway below)
        self._controls = []
        while self.relays:
            relay = self.relays.pop()
            relay.kill()  # its namespace lives on, unnamed, while a process is inside it
            try:
                relay.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        while self.made:
            _run("ip", "netns", "del", self.made.pop(), check=False)
        for sig, handler in self._previous_handlers.items():
            try:
                signal.signal(sig, handler)
            except (ValueError, TypeError):  # (not the main thread, or a handler set from C)
                pass
        self._previous_handlers = {}
        atexit.unregister(self.close)

    def _on_signal(self, signum: int, frame) -> None:
        self.close()
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise SystemExit(128 + signum)

    # ------------------------------------------------------------------ running inside
    @staticmethod
    def ns_run(ns: str, *argv: str, check: bool = True) -> subprocess.CompletedProcess:
        return _run("ip", "netns", "exec", ns, *argv, check=check)

    def machine_env(self, machine: int, base: Optional[Dict[str, str]] = None) -> Dict[str, str]:
        """The environment of machine ``machine``'s processes: gloo binds the veth end (its address is what the
        other machine connects to), the rendezvous is machine 0's address."""
        env = dict(os.environ if base is None else base)
        env.update(GLOO_SOCKET_IFNAME=self.devices[machine], MASTER_ADDR=self.addresses[0])
        return env

    def popen(self, machine: int, argv: Sequence[str], **kwargs) -> subprocess.Popen:
        """Start ``argv`` inside machine ``machine``'s namespace."""
        return subprocess.Popen(["ip", "netns", "exec", self.names[machine], *argv], **kwargs)

    def tx_bytes(self, machine: int) -> int:
        """Bytes machine ``machine`` has sent over the link so far (its veth end's counter)."""
        out = self.ns_run(self.names[machine], "cat", f"/sys/class/net/{self.devices[machine]}/statistics/tx_bytes")
        return int(out.stdout)

    # ------------------------------------------------------------------ the relay wire
    def _start_relays(self) -> None:
        """One ``tun_relay.py`` per namespace, joined by a datagram socketpair (one datagram per packet)."""
        ends = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            for machine, (ns, dev, end) in enumerate(zip(self.names, self.devices, ends)):
                ours_end, relay_end = socket.socketpair()
                self._controls.append(ours_end)
                fds = (end.fileno(), relay_end.fileno())
                self.relays.append(subprocess.Popen(
                    ["ip", "netns", "exec", ns, sys.executable, RELAY, dev, *map(str, fds), str(self.seed + machine)],
                    pass_fds=fds))
                relay_end.close()
        finally:
            for end in ends:
                end.close()
        for control in self._controls:
            self._answer(control)

    def _answer(self, control: socket.socket) -> List[int]:
        """A relay's answer ``ok <dropped> <sent>``: its packet counts."""
        control.settimeout(30)
        answer = b""
        try:
            while not answer.endswith(b"\n"):
                chunk = control.recv(64)
                if not chunk:
                    break
                answer += chunk
        except socket.timeout:
            pass
        if not answer.startswith(b"ok "):
            codes = [r.poll() for r in self.relays]
            raise RuntimeError(f"a tun relay did not answer (exit codes {codes}): see its stderr above")
        return [int(n) for n in answer.split()[1:]]

    def _tell_relays(self, loss_pct: float, delay_ms: float, down: bool) -> List[List[int]]:
        """Set the relays' faults; returns once both apply them, with their [dropped, sent] counts."""
        for control in self._controls:
            control.sendall(f"{loss_pct} {delay_ms} {int(down)}\n".encode())
        return [self._answer(control) for control in self._controls]

    def relay_counts(self) -> Dict[str, int]:
        """Packets the relays dropped and passed so far, both directions together (relay wire only)."""
        if self.wire != "relay":
            raise ValueError("relay_counts: only the relay wire counts its packets")
        s = self.shaping
        counts = self._tell_relays(s.get("loss_pct", 0.0), s.get("delay_ms", 0.0), down=self._down)
        return {"dropped": sum(c[0] for c in counts), "sent": sum(c[1] for c in counts)}

    # ------------------------------------------------------------------ the link's shape
    def shape(self, rate_gbit: Optional[float] = None, delay_ms: float = 0.0, loss_pct: float = 0.0) -> None:
        """Both directions: ``rate_gbit`` (None: unshaped; veth then moves data at memory speed), one-way
        ``delay_ms`` and random ``loss_pct``: on the veth wire by netem (parent of the tbf), which some kernels lack
        (then :class:`LinkUnavailable` says so); on the relay wire by the relays."""
        netem_on_veth = self.wire == "veth" and bool(delay_ms or loss_pct)
        for ns, dev in zip(self.names, self.devices):
            self.ns_run(ns, "tc", "qdisc", "del", "dev", dev, "root", check=False)
            parent = ["root"]
            if netem_on_veth:
                netem = ["netem", "limit", "100000"]
                if delay_ms:
                    netem += ["delay", f"{delay_ms}ms"]
                if loss_pct:
                    netem += ["loss", f"{loss_pct}%"]
                done = self.ns_run(ns, "tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", *netem, check=False)
                if done.returncode != 0:
                    raise LinkUnavailable(f"{NO_NETEM} ({done.stderr.strip()})")
                parent = ["parent", "1:1"]
            if rate_gbit:
                # burst: ~1 ms at the rate (at least 64 KiB, what one TSO segment can be); latency bounds the queue
                burst = max(65536, int(rate_gbit * 1e9 / 8 / 1000))
                self.ns_run(ns, "tc", "qdisc", "add", "dev", dev, *parent, "handle", "2:", "tbf", "rate",
                            f"{rate_gbit * 1000:g}mbit", "burst", str(burst), "latency", "100ms")
        if self.wire == "relay":
            self._tell_relays(loss_pct, delay_ms, down=False)
        self.shaping = {"rate_gbit": rate_gbit or 0.0, "delay_ms": delay_ms, "loss_pct": loss_pct}

    def outage(self, down: bool) -> None:
        """``down``: drop every packet in both directions (a pulled cable: TCP keeps retrying, connections
        survive a short outage); else restore the shape set by the last :meth:`shape`.  Veth: a ``pfifo`` of
        limit 0 on both ends (it drops all it is given; needs no netem, and unlike ``ip link set down`` leaves the
        routes, so senders see a silent loss, not "no route"); relay: the relays drop everything."""
        self._down = down
        if not down:
            s = self.shaping
            self.shape(s.get("rate_gbit") or None, s.get("delay_ms", 0.0), s.get("loss_pct", 0.0))
        elif self.wire == "relay":
            s = self.shaping
            self._tell_relays(s.get("loss_pct", 0.0), s.get("delay_ms", 0.0), down=True)
        else:
            for ns, dev in zip(self.names, self.devices):
                self.ns_run(ns, "tc", "qdisc", "del", "dev", dev, "root", check=False)
                self.ns_run(ns, "tc", "qdisc", "add", "dev", dev, "root", "pfifo", "limit", "0")

    def measure_gbit(self, seconds: float = 1.0) -> float:
        """Throughput machine 0 -> 1 over the link (one TCP stream for ``seconds``), for checking a shape."""
        receiver = self.popen(1, [sys.executable, "-c", _SINK, self.addresses[1]], stdout=subprocess.PIPE, text=True)
        try:
            time.sleep(0.5)
            sender = self.popen(0, [sys.executable, "-c", _SOURCE, self.addresses[1], str(seconds)],
                                stdout=subprocess.PIPE, text=True)
            out, _ = sender.communicate(timeout=seconds + 30)
            return float(out.strip())
        finally:
            receiver.kill()
            receiver.wait()


_SINK = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind((sys.argv[1], 29511)); s.listen(1)
c, _ = s.accept()
while c.recv(1 << 20):
    pass
"""
_SOURCE = """
import socket, sys, time
c = socket.create_connection((sys.argv[1], 29511)); buf = b"x" * (1 << 20); n = 0
start = time.time(); end = start + float(sys.argv[2])
while time.time() < end:
    c.sendall(buf); n += len(buf)
print(n * 8 / (time.time() - start) / 1e9)
"""
