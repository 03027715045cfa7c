"""What this host's CPU and RAM offer, read from /proc: the CPU flags (the CPU platform's dtype
choice, the C kernels' cache key) and the available RAM (the CPU platform's budgets)."""
import os


def cpu_flags_line() -> str:
    """The first "flags" line of /proc/cpuinfo as written there; "" where it cannot be read."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return line
    except OSError:
        pass
    return ""


def available_ram_bytes() -> int:
    """MemAvailable of /proc/meminfo, else the free physical pages."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
