"""One end of netlink's ``relay`` wire: moves IP packets between this namespace's tun device and the other end.

    ip netns exec NS python tun_relay.py DEV PEER_FD CONTROL_FD SEED     # started by netlink.EmulatedLink only

Why a userspace wire: some kernels have no ``netem`` qdisc (and no tc classifiers or iptables), so packet loss and
delay cannot be made in the kernel; a tun device can be made in any namespace.  Each namespace has a tun device
with the link's address; the relay of each namespace attaches to it (TUNSETIFF: a process attaches to a device of
its own namespace, and Python 3.11 has no ``os.setns``, hence one relay process per namespace) and the two relays
exchange packets over a datagram socketpair made by their parent (``PEER_FD``: one datagram per packet).

A relay applies the faults to what its own machine sends (so each direction is faulted once): drops each packet
with probability ``loss_pct / 100``, holds each for ``delay_ms`` (one way: a constant delay keeps the order), and
in an outage drops everything.  ``CONTROL_FD`` is a stream socket to the parent: a line ``loss delay down`` sets
them and is answered ``ok <packets dropped> <packets sent>`` (this relay's counts so far); end of file (the parent
is gone, even killed with SIGKILL) ends the relay, which releases the namespace.
"""
from __future__ import annotations

import collections
import fcntl
import os
import random
import select
import socket
import struct
import sys
import time

TUNSETIFF = 0x400454CA
IFF_TUN, IFF_NO_PI = 0x0001, 0x1000
BATCH = 64  # packets moved per wake-up and direction: fewer select calls under load


def attach(dev: str) -> int:
    """A non-blocking fd of tun device ``dev`` (made by ``ip tuntap add``) in this process's namespace."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", dev.encode(), IFF_TUN | IFF_NO_PI))
    return fd


def main() -> None:
    dev, peer_fd, control_fd, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    tun = attach(dev)
    peer = socket.socket(fileno=peer_fd)
    peer.setblocking(False)  # a full peer queue drops the packet (a router's full queue), never a deadlock
    control = socket.socket(fileno=control_fd)
    rng = random.Random(seed)
    loss_pct, delay_s, down = 0.0, 0.0, False
    held: collections.deque = collections.deque()  # (time to send, packet), in order
    pending = b""
    dropped = sent = 0
    control.sendall(b"ok 0 0\n")  # attached: the parent may send traffic now

    def send(packet: bytes) -> None:
        try:
            peer.send(packet)
        except (BlockingIOError, ConnectionRefusedError):
            pass  # dropped (the other relay is slow or gone); TCP retransmits

    while True:
        timeout = max(0.0, held[0][0] - time.monotonic()) if held else None
        ready, _, _ = select.select([tun, peer, control], [], [], timeout)
        now = time.monotonic()
        if tun in ready:  # this machine sends: the faults apply here
            for _ in range(BATCH):
                try:
                    packet = os.read(tun, 65536)
                except BlockingIOError:
                    break
                if down or (loss_pct and rng.random() * 100.0 < loss_pct):
                    dropped += 1
                    continue
                sent += 1
                if delay_s:
                    held.append((now + delay_s, packet))
                else:
                    send(packet)
        while held and held[0][0] <= now:
            send(held.popleft()[1])
        if peer in ready:  # the other machine's packets, already faulted there
            for _ in range(BATCH):
                try:
                    os.write(tun, peer.recv(65536))
                except BlockingIOError:
                    break
        if control in ready:
            data = control.recv(4096)
            if not data:
                return  # the parent is gone: so is the link
            pending += data
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                loss, delay_ms, outage = line.split()
                loss_pct, delay_s, down = float(loss), float(delay_ms) / 1000.0, outage == b"1"
                if down:
                    held.clear()  # (a pulled cable loses what was on it)
                control.sendall(f"ok {dropped} {sent}\n".encode())


if __name__ == "__main__":
    main()
