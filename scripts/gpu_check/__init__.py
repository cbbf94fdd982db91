"""`make gpu-check`'s stages: pass/fail checks of the CUDA path (`check` runs them, each in a process of its
own: `exact`, `kernels`, `perf`, `tp`). Outside the package: the wheel does not ship them."""
