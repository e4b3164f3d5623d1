"""Training: the trainer and its step (trainer.py), optimizers and schedules (optim.py), the EMA of the
weights (ema.py), validation during training (validation.py), the divergence watch (divergence.py),
compile parity (parity.py), the compiled step's check against eager at run time (compile_check.py),
the SDPA kernels a compiled CUDA step may use (sdpa.py), fine-tuning a classifier on labels (finetune.py), console and
TensorBoard reporting (report.py, loggers.py).
"""
