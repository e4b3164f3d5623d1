"""The process a run lives in: device, precision, compilation and randomness (process.py),
torchrun's world and its collectives (distributed.py), free memory and out-of-memory handling
(memory.py; what a config needs is estimated in model/memory_estimate.py), and how OpenMP's threads
wait on a shared CPU (openmp.py).
"""
