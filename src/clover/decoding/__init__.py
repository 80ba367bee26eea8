"""Decoding strategies: one file each (ar, diffusion, naive, speculative), sharing sampling and base."""
