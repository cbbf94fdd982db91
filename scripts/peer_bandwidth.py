"""Read bandwidth inside a peer's own process (scripts/peer_llamacpp.py, peer_openvino.py), as the
engine's is read inside its own (`fms_paged.bench.environment.measure_read_bandwidth`): on a VM a
process's memory bandwidth depends on where its memory landed, so a decode rate compares across
processes only beside its process's bandwidth. numpy alone (the peers' venvs have no torch): one
float32 sum per core over its share of 1 GiB, the sums in threads (numpy releases the GIL inside
a reduction), the fastest of ten after a warm-up."""

from __future__ import annotations

import os
import threading
import time


def read_bandwidth_gbs(nbytes: int = 2**30, repeats: int = 10) -> float:
    import numpy as np

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    x = np.ones(nbytes // 4, dtype=np.float32)
    parts = np.array_split(x, cores)
    times = []
    for _ in range(repeats + 1):
        threads = [threading.Thread(target=np.add.reduce, args=(p,)) for p in parts]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        times.append(time.perf_counter() - t0)
    return nbytes / min(times[1:]) / 1e9
