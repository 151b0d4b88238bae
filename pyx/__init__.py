# libgomp reads its wait policy from the environment once, when the first extension that links it
# loads: set Taper's default (pyx/cpu_threads.py) before any of them can, unless the user chose.
from pyx import cpu_threads as _cpu_threads

_cpu_threads.apply_wait_policy()
