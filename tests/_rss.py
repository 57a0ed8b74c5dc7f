"""Peak resident memory of a call (Linux): reset the peak mark (``echo 5 > /proc/self/clear_refs``), record VmRSS,
run it, read VmHWM. The growth is VmHWM - VmRSS: the extra resident memory at the call's peak."""

from __future__ import annotations


def rss_status() -> dict[str, int]:
    """VmHWM and VmRSS of this process, in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmHWM", "VmRSS"):
                out[key] = int(value.split()[0]) * 1024  # kB -> bytes
    return out


def peak_growth(fn) -> int:
    """Peak resident bytes ``fn()`` adds on top of the current RSS."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = rss_status()["VmRSS"]
    fn()
    return rss_status()["VmHWM"] - before


def read_chars() -> int:
    """Bytes this process has read so far (``rchar`` of /proc/self/io: every read call, page cache hits included)."""
    with open("/proc/self/io") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key == "rchar":
                return int(value)
    raise RuntimeError("/proc/self/io has no rchar")
