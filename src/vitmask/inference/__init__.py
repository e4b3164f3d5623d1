"""Using a trained model from Python and from `vitmask predict`: images in, answers out.

`load_classifier(PATH)` (classifier.py) is a fine-tuned classifier with its preprocessing:
`logits`, `predict` (top-k classes, names, probabilities) and `features` of images. `load_masked_model(PATH)`
(masked.py) is the pretrained masked-patch model with the same preprocessing: encoder `features` as
`vitmask probe` pools them, and the `logits` and `fill` of hidden patches. What `vitmask predict`
reads (an image, a folder, an npz archive, a pack) is inputs.py; the records it writes, predictions.py.
Opening a model by name or path as every verb that reads one does (`open_model`, which vitmask demo
uses too) is open.py.
"""
