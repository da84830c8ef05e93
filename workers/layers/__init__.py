"""Model building blocks: norms, rotary embeddings, activations, paged attention."""
