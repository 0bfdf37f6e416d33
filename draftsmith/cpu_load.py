"""How busy other processes keep the CPU, for timings that must be taken on a quiet machine (bench rounds, the
forward-cost profile): on a shared 2-core VM, another process's burst of work makes a 2-thread matmul 20x
slower for a while. Linux only (/proc/stat); elsewhere the machine always reads quiet."""

from __future__ import annotations

import os
import time
from pathlib import Path

STAT = Path("/proc/stat")
BUSY_LIMIT = 0.15  # cores' worth of CPU that other processes may use while a round starts
SAMPLE_S = 0.5


def _cpu_seconds() -> tuple[float, float] | None:
    """(busy, this process and its children's) CPU seconds since boot, or None without /proc/stat."""
    try:
        fields = STAT.read_text().split("\n", 1)[0].split()[1:]
    except OSError:
        return None
    ticks = os.sysconf("SC_CLK_TCK")
    values = [int(v) for v in fields]
    busy = (sum(values) - values[3] - (values[4] if len(values) > 4 else 0)) / ticks  # less idle and iowait
    own = os.times()
    return busy, own.user + own.system + own.children_user + own.children_system


class OthersBusy:
    """Cores' worth of CPU that other processes used between its creation and `cores()`."""

    def __init__(self):
        self.start, self.started = _cpu_seconds(), time.monotonic()

    def cores(self) -> float:
        end, seconds = _cpu_seconds(), time.monotonic() - self.started
        if self.start is None or end is None or seconds <= 0:
            return 0.0
        return max((end[0] - self.start[0]) - (end[1] - self.start[1]), 0.0) / seconds


def others_busy(sample_s: float = SAMPLE_S) -> float:
    """Cores' worth of CPU that other processes used over `sample_s` seconds (0.0 where unknown)."""
    span = OthersBusy()
    time.sleep(sample_s)
    return span.cores()


def wait_for_quiet(limit: float = BUSY_LIMIT, max_wait_s: float = 120.0, log=print) -> float:
    """Waits until other processes use under `limit` cores, at most `max_wait_s`; -> their last usage. Says
    once that it waits, and whether it gave up."""
    deadline, told = time.monotonic() + max_wait_s, False
    while True:
        busy = others_busy()
        if busy < limit:
            return busy
        if time.monotonic() >= deadline:
            log(f"  machine still busy after {max_wait_s:.0f} s ({busy:.2f} cores used by other processes): timing anyway")
            return busy
        if not told:
            log(f"  waiting for a quiet machine ({busy:.2f} cores used by other processes)")
            told = True
