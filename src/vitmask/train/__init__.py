"""Training: the trainer and its step (trainer.py), optimizers and schedules (optim.py), validation
during training (validation.py), the divergence watch (divergence.py), console and TensorBoard
reporting (report.py, loggers.py).
"""
