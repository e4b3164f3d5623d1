"""Images in, batches out: the sources (sources.py, shapes.py), reading and binarising image files
(imagefile.py, preprocess.py), patches and their token classes (patches.py), drawing masks (masking.py),
splits, batches and the sampler (batches.py), a step's images gathered ahead (prefetch.py), the
packed format and `vitmask pack` (packed.py, pack.py), the dataset preview (preview.py), picture
grids and their PNG files (grid.py), a model's preprocessing for a user's images (processor.py), a
user's JSON file read with limits (jsonfile.py), a bounded subset of each class (per_class.py), the
classes' names (class_names.py), and how images were made binary: the record a pack or a model
keeps, which runs follow, and the foreground-share checks (binarization.py).
"""
