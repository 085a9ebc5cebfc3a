"""BAGEL-7B-MoT: a Mixture-of-Transformers LLM with a SigLIP NaViT encoder and the FLUX VAE (chat, images, edits)."""
