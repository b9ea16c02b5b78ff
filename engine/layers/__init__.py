"""Building blocks shared by every decoder family."""
