"""Tandem's torch-free shared core.

Everything here imports without torch so the router (and any tooling) can use it:
block hashing, sampling parameters, the tokenizer wrapper, model-config parsing, the
Redis registry and the `tandem` command line.
"""
