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
for _ in range(20):  # a step: 8 activations of 4 MiB made and written, then all freed
    bufs = [torch.empty(1 << 20).fill_(1.0) for _ in range(8)]
    del bufs
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_buffers_are_reused_without_page_faults():
    """Each a fresh process: without the call, glibc trims the heap when a step's 32 MiB are freed
    and every step faults its pages in again (8,192 faults of 4 KiB); with it, the first step's
    pages serve the other 19."""
    def faults(mode: str) -> int:
        run = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True)
        return int(run.stdout.split()[-1])

    plain, kept = faults("plain"), faults("keep")
    assert plain > 20 * 8192 * 0.9
    assert kept < 2 * 8192
