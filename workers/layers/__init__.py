"""Model building blocks: linear, attention, norm, rotary, embedding."""
