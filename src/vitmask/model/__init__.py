"""The network: the masked-patch ViT (vit.py), its optional decoders (decoder.py), the fine-tuned
classifier on its encoder (classifier.py) and token pooling (pooling.py), and what a config
costs before anything is trained: the parameter table (params.py) and the FLOP count (flops.py).
"""
