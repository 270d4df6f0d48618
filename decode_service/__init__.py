"""Decode worker: continuous batching over requests whose prompt KV arrived."""
