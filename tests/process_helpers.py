"""Helpers of the multi-process server tests: free loopback ports, process liveness from /proc."""
import os
import socket
import sys
import time
from pathlib import Path

IS_LINUX = sys.platform.startswith("linux")


def is_alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text() if IS_LINUX else None
    except OSError:
        return False
    if stat is None:
        try:
            os.kill(pid, 0)
            return True
        except OSError:
            return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended


def children_of(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry))
        except OSError:
            continue
    return found


def wait_until(condition, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def free_ports(count: int) -> int:
    """A base port with `count` consecutive free ports after it."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + count <= 65535 and all(port_is_free(base + i) for i in range(count)):
            return base
    raise RuntimeError("no run of free ports")


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def stop(proc) -> None:
    """SIGTERM a subprocess and wait for it; kill it if it has not ended within 30 s."""
    import subprocess
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
