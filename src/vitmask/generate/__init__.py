"""Filling masked patches: iterative decoding and unconditional sampling (sampling.py), and inpainting
boxes or a mask image in a user's picture (inpaint.py).
"""
