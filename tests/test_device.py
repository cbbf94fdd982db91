"""`fms_paged.device.keep_freed_cpu_memory`: glibc's malloc then reuses freed buffers."""

import subprocess
import sys

import pytest

PROBE = """
import resource, sys, torch
from fms_paged.device import keep_freed_cpu_memory
if sys.argv[1] == "keep":
    assert keep_freed_cpu_memory()
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(40):  # a step: 8 activations of 4 MiB made and written, then all freed
    bufs = [torch.empty(1 << 20).fill_(1.0) for _ in range(8)]
    del bufs
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_buffers_are_reused_without_page_faults():
    """In a fresh process with the call, the first step's pages (8,192 faults of 4 KiB) serve the
    other 39 steps: 9,100-16,400 faults in all here (the process's other allocations fault too;
    the bound, 4 steps' worth, is still 10x under the trimming run's). Without it, glibc trims the
    heap when a step's
    32 MiB are freed and faults them in again, 8,192 a step (326,000 in all), in most processes
    here; in some (where the heap lands in the address space, it seems) it trims nothing, so the
    plain run is only printed, never asserted."""
    def faults(mode: str) -> int:
        run = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True)
        return int(run.stdout.split()[-1])

    plain, kept = faults("plain"), faults("keep")
    print(f"page faults over 40 steps: {plain} plain, {kept} kept")
    assert kept < 4 * 8192, (plain, kept)
