"""What every question stands on: the forward pass, KV caches, model loading, the decode engine, samplers."""
