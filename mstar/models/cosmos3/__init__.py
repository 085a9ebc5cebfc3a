"""Cosmos3 (Nano, Super, Policy DROID): the MoT generator over Wan2.2 VAE latents, served."""
