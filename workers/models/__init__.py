"""workers/models."""
