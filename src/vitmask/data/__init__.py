"""Images in, batches out: the sources (sources.py, shapes.py), reading and binarising image files
(imagefile.py, preprocess.py), patches and their token classes (patches.py), drawing masks (masking.py),
splits, batches and the sampler (batches.py), the dataset preview (preview.py), a model's
preprocessing for a user's images (processor.py), a bounded subset of each class (per_class.py) and
the classes' names (class_names.py).
"""
