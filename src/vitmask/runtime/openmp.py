"""How torch's CPU threads wait for each other: short spins, so a shared CPU is shared fairly.

torch runs its CPU ops on OpenMP threads (libgomp), one per core. At the end of every parallel
region the threads that finish first wait for the last one, spinning on the core for up to
GOMP_SPINCOUNT iterations (300,000 by default) before they sleep. On a machine with no other work
that is the fastest wait. Beside one other CPU-bound process it is the slowest: the thread that the
scheduler has set aside for the other process is waited for by a thread that burns the core it
could run on, every op of every step. On the 2-core VM of docs/benchmarks.md configs/mnist.yaml
trained at 11 to 25 images/s beside one busy process, against 218 to 234 alone (a twentieth to a
tenth); with spins of 4,000 iterations it trains at 230 alone and 111 beside it (half: the fair
share of one core of two), and one thread, or no spinning at all (OMP_WAIT_POLICY=passive), cost
a quarter of the speed alone (scripts/bench_shared_cpu.py).

libgomp reads its settings once, when torch is imported, so `share_cpus_fairly` runs first in the
CLI's process (cli/entry.py), before anything imports torch. A user's own OpenMP wait settings
are left as they are.
"""

import os

SPIN_COUNT = "4000"  # GOMP_SPINCOUNT: iterations a waiting thread spins before it sleeps
USER_SETTINGS = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY", "KMP_BLOCKTIME")


def share_cpus_fairly(environ=os.environ) -> bool:
    """Set GOMP_SPINCOUNT (before torch is imported) unless the user chose a wait setting; returns
    whether it was set."""
    if any(k in environ for k in USER_SETTINGS):
        return False
    environ["GOMP_SPINCOUNT"] = SPIN_COUNT
    return True
