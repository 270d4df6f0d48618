"""Tandem's shared engine core: model, paged KV cache, scheduler, sampler, runner.

Importing this package loads nothing heavy; ``engine.tokenizer``,
``engine.detokenizer`` and ``engine.sampling_params`` are torch-free and are
what the gateway uses.
"""
