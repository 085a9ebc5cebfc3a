"""Wan2.2-TI2V-5B: UMT5 text encoder, video DiT, guidance scheduler component (the VAE lives in vae.py)."""
