"""What a run keeps on disk: the checkpoint file format and atomic writes (checkpoint.py), when a
run writes its checkpoints (saving.py), the run dir with its lock, resume and leftovers
(rundir.py), the one reader of a trained model's files (model_files.py), exported models
(export.py, onnx_export.py), fine-tuned classifiers on disk (classifier.py) and the weights a new
run starts from (init_weights.py).

Named `store`, not `runs`: `runs/` is where runs are written, and a user's ignore rules for it must
never hide this package's source.
"""
