"""The process a run lives in: device, precision, compilation and randomness (process.py),
torchrun's world and its collectives (distributed.py), and memory estimates and out-of-memory
handling (memory.py).
"""
