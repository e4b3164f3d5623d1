"""Images in, batches out: the sources (sources.py, shapes.py), reading and binarising image files
(imagefile.py, preprocess.py), patches and their token classes (patches.py), masks (masking.py),
splits, batches and the sampler (batches.py), and the dataset preview (preview.py).
"""
