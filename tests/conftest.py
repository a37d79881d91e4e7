"""Settings every test process shares.

[Note: one compute thread per test process]
Every process the suite starts computes on one thread: ``OMP_NUM_THREADS=1`` is set here (unless
the caller set it), before any test module imports torch, so the pytest workers, the forkserver
that starts the ranks of tests/dist_utils.py (whose ranks also call ``torch.set_num_threads(1)``)
and every launched job inherit it. The suite runs two pytest workers, each often beside 2-3 rank
processes, on 2 cores: with torch's default (one OpenMP thread per core) the idle threads of one
process spin waiting for work while another process needs the core, and the tiny models' ops
gain nothing from a second thread. Measured: tests/test_models_heads.py's two largest tests took
98 s and 61 s with the default, 36 s and 31 s with one thread, beside the same load.

[Note: test file order]
The README's test command leaves the order of the files to xdist (``--dist loadfile`` hands the
files with the most tests out first). An order with the longest-running files first was kept
here until it was found that xdist's default reordering had always overridden it; honoured
(``--no-loadscope-reorder``), it was slower: 857.9 s against 777.8 s for xdist's order on the
quiet 2-core machine (fresh clones, cold inductor cache; the first run had 7 more tests),
because the multi-process files then run beside each other (4-6 processes on 2 cores:
tests/test_compile.py 146 s against 108 s, tests/test_plan_memory.py 64 s against 32 s), where
xdist's order sets them beside in-process files.
"""


import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
