"""A run on disk: the checkpoint file format and atomic writes (checkpoint.py), when a run writes its
checkpoints (saving.py), and the run dir with its lock, resume and leftovers (rundir.py).
"""
