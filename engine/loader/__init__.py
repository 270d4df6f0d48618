"""Model loading: turn what a user points at (a GGUF file, a Hugging Face-style directory)
into one on-disk layout the engine reads."""
