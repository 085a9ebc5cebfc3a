"""V-JEPA 2 (video encoder, mask predictor, classifier head) and V-JEPA 2-AC (action-conditioned predictor)."""
