"""Triton kernels with thin, checked launchers, and their torch reference.

Import launchers from their modules; this package imports nothing, so that
``import kernels.reference`` (the CPU engine path) never imports Triton::

    kernels.reference           the torch maths every kernel is tested against
    kernels.store_kv            store_kv
    kernels.decode_attention    paged_decode_attention
    kernels.prefill_attention   paged_prefill_attention
    kernels.rms_norm            rms_norm (fused residual add)
    kernels.rotary              apply_rotary
    kernels.quant_matmul        quant_matmul (GPTQ/AWQ/pack-quantized integers)
    kernels.scaled_matmul       scaled_matmul (8-bit INT8/FP8 weights, W8A16)

NOTE: no lazy re-exports here: ``kernels.store_kv`` is both a module and the
function in it, and the import system rebinds the package attribute to the
module, so a re-exported name would change meaning after the first import.
"""
