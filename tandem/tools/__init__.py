"""Tooling apart from the runtime: making checkpoints for tests and the demo.

- ``checkpoint_maker``: random-weight HuggingFace checkpoints of the supported families;
- ``checkpoint_tokenizer``: the byte-level BPE tokenizer those checkpoints ship;
- ``training``: trains a preset on the standard library's sources (``--train``).

Nothing in the serving path imports this package; ``tandem make-model`` does.
"""
