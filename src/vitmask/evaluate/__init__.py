"""Scoring a model: masked-patch accuracy over a split (scores.py), the metrics it sums (metrics.py),
the model-free baselines (baselines.py), the likelihood bound (likelihood.py), exact NLLs of fixed
orders and their mixtures (exact_nll.py), linear and k-NN probes (probe.py), a fine-tuned
classifier's accuracy and confusion matrix (classify.py), and the pictures drawn from predictions
(pictures.py).
"""
