"""serve/engine/host_memory.py: after tuning, a loop that allocates and frees large buffers stops faulting in fresh
pages on every pass. Each case runs in its own interpreter: malloc settings are per process and not undone."""

import subprocess
import sys

import pytest

SCRIPT = """
import resource, sys, torch
from draftsmith.serve.engine.host_memory import keep_freed_memory
tuned = keep_freed_memory() if sys.argv[1] == "tune" else False
def churn():  # like a forward: many buffers alive at once, all freed at the end
    for _ in range(10):
        alive = [torch.ones(100_000) for _ in range(64)]  # 64 x 0.4 MiB: above glibc's first mmap threshold
        del alive
churn()  # the first pass may grow the heap
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
churn()
print(tuned, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str, env: dict | None = None) -> tuple[bool, int]:
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, check=True, env=env)
    tuned, faults = out.stdout.split()
    return tuned == "True", int(faults)


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc tuning is Linux-only")
def test_freed_buffers_are_reused_instead_of_refaulted():
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    tuned, faults = _faults("tune", env)
    if not tuned:
        pytest.skip("this libc has no mallopt (not glibc)")
    # glibc's default mmap threshold, pinned: left dynamic, whether it has risen past these buffers depends
    # on what the interpreter allocated before (it did in some runs, not in others)
    pinned, untuned = _faults("tune", env | {"MALLOC_MMAP_THRESHOLD_": "131072"})
    assert not pinned  # a MALLOC_ variable of the user's own wins
    # untuned: every 0.4 MiB buffer is a fresh mmap, faulted in again on each pass (about 6k faults a
    # pass); tuned: the heap's pages are reused
    assert untuned > 10_000 and faults < untuned / 10, (faults, untuned)
    opted_out, _ = _faults("tune", env | {"DRAFTSMITH_MALLOC": "default"})
    assert not opted_out
