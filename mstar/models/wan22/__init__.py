"""Wan2.2-TI2V-5B: UMT5 text encoder, video DiT and guidance scheduler (its VAE is `models/common/wan_vae`)."""
