"""Attention over the paged KV cache, behind one small interface (see ``base``)."""
