"""Two network namespaces joined by a veth pair, for the P/D partition test: the producer's
namespace (``ADDR_P``) and the consumer's (``ADDR_D``), link-local addresses that never leave the
pair. As kvx-rdma's tests/remote/netns.rs, in Python."""

from __future__ import annotations

import os
import shutil
import subprocess

ADDR_P = "169.254.79.1"
ADDR_D = "169.254.79.2"


def ip(*args: str) -> None:
    """Run ``ip ARGS``; raises with its stderr when it fails."""
    out = subprocess.run(["ip", *args], check=False, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed: {out.stderr.strip()}")


def unavailable() -> str | None:
    """Why namespaces cannot be made here (None: they can; probed by making one)."""
    if shutil.which("ip") is None:
        return "no `ip` command"
    name = f"kvxpdprobe{os.getpid()}"
    try:
        ip("netns", "add", name)
        ip("netns", "del", name)
    except (RuntimeError, OSError) as e:
        return str(e)
    return None


class Pair:
    """Namespaces ``p`` and ``d`` and the veth between them; ``close()`` removes them."""

    def __init__(self) -> None:
        n = os.getpid() % 100_000
        self.p, self.d = f"kvxpdp{n}", f"kvxpdd{n}"
        self.veth_p, veth_d = f"kvxpdvp{n}", f"kvxpdvd{n}"
        try:
            ip("netns", "add", self.p)
            ip("netns", "add", self.d)
            ip("link", "add", self.veth_p, "type", "veth", "peer", "name", veth_d)
            ip("link", "set", self.veth_p, "netns", self.p)
            ip("link", "set", veth_d, "netns", self.d)
            ip("-n", self.p, "addr", "add", f"{ADDR_P}/30", "dev", self.veth_p)
            ip("-n", self.d, "addr", "add", f"{ADDR_D}/30", "dev", veth_d)
            for ns, dev in ((self.p, self.veth_p), (self.d, veth_d)):
                ip("-n", ns, "link", "set", "lo", "up")
                ip("-n", ns, "link", "set", dev, "up")
        except BaseException:
            self.close()
            raise

    @staticmethod
    def exec(ns: str) -> list[str]:
        """The command prefix that runs a program in namespace ``ns``."""
        return ["ip", "netns", "exec", ns]

    def cut(self) -> None:
        """Partition: the producer's end of the link goes down (packets vanish, no reset)."""
        ip("-n", self.p, "link", "set", self.veth_p, "down")

    def close(self) -> None:
        """Remove both namespaces (and with them the veth pair); never raises."""
        for ns in (self.p, self.d):
            subprocess.run(["ip", "netns", "del", ns], check=False, capture_output=True)
