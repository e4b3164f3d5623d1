"""The network: the masked-patch ViT (vit.py), its shared layers (layers.py: attention, FFN, token
convolution, norms, the block) and positions (positions.py), what it reads of a masked image
(masked_input.py: the fill, the indices of hidden and visible patches), its optional decoders
(decoder.py), the fine-tuned classifier on its encoder (classifier.py) and token pooling with its
names (pooling.py), and what a config costs before anything is trained: the parameter table
(params.py), the FLOP count (flops.py) and the memory estimate (memory_estimate.py). Nothing here
imports data/: what both need is the leaf vitmask/sizes.py.
"""
