"""Prefill worker: runs prompts and hands their KV to decode workers."""
