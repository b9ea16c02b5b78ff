"""Speculative decoding: cheap proposers guess several next tokens, the target model
checks them all in one forward pass, and rejection sampling keeps exactly the target's
output distribution (greedy output unchanged, token for token)."""
