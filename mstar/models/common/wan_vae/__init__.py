"""The Wan2.2 VAE that Wan2.2 and Cosmos3 share: video <-> latents, its config, weights, kernels and component."""
