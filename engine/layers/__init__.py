"""Building blocks shared by the model architectures."""
