"""What one tensor-parallel rank holds: its slice of the model's weights and
its slice of every layer's KV cache (its kv heads). With one rank, the
whole model and the whole cache."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from engine.attention import get_attention_backend
from engine.batch import StepBatch
from engine.config import EngineConfig, ModelConfig
from engine.dtypes import torch_dtype
from engine.kv_blocks import KVBlocks
from engine.kv_quant import KVCacheSpec, check_kv_cache_support
from engine.loader.weights import iterate_weights
from engine.models import build_model
from engine.parallel import TensorParallel
from engine.weight_offload import WeightOffload

logger = logging.getLogger("engine")


class ModelShard:
    def __init__(self, config: EngineConfig, model_cfg: ModelConfig, model_dir: Path,
                 max_model_len: int, tp: TensorParallel) -> None:
        self.config = config
        self.model_cfg = model_cfg
        self.tp = tp
        self.device = torch.device(config.device)
        self.dtype = torch_dtype(config.dtype)
        self.block_size = config.cache.block_size
        self.kv_spec = KVCacheSpec.of(config.cache.kv_cache_dtype, config.dtype)
        self.backend = get_attention_backend(config.attention_backend, config.device,
                                             self.kv_spec.scales)
        check_kv_cache_support(self.kv_spec, self.backend.name, self.device)
        torch.manual_seed(config.seed)
        default_dtype = torch.get_default_dtype()
        try:
            torch.set_default_dtype(self.dtype)
            with torch.device(self.device):
                self.model = build_model(model_cfg, self.backend, max_model_len, tp)
        finally:
            torch.set_default_dtype(default_dtype)
        if config.load_format == "dummy":
            self._init_dummy_weights()
        else:
            self.model.load_weights(iterate_weights(model_dir))
        for module in self.model.modules():  # quantization="fp8": quantize what was loaded
            if hasattr(module, "finish_loading"):
                module.finish_loading()
        self.model.eval()
        self.offload = self._offload_weights()
        self.num_kv_heads = tp.split(model_cfg.num_kv_heads, "num_key_value_heads")
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []

    def _offload_weights(self) -> WeightOffload | None:
        """``cpu_offload_gb`` of this rank's decoder layers to pinned host memory."""
        if not self.config.cpu_offload_gb:
            return None
        offload = WeightOffload(list(self.model.layers), self.config.cpu_offload_gb,
                                self.device, pin=self.device.type == "cuda")
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # so that the KV cache sizing sees the memory freed
        logger.info("cpu offload: %d decoder layers, %.2f GB of weights in host memory",
                    offload.num_layers, offload.bytes_offloaded / 1e9)
        return offload

    @torch.no_grad()
    def _init_dummy_weights(self) -> None:
        # One seed per rank: every random weight is split across the ranks
        # (the norms, which all hold whole, are filled with ones), so each
        # rank's slice differs as slices of one model would.
        gen = torch.Generator(device=self.device).manual_seed(self.config.seed + self.tp.rank)
        for name, param in self.model.named_parameters():
            if not param.is_floating_point():  # quantized layers
                if name.endswith("qweight"):
                    param.random_(generator=gen)  # random integers; g_idx keeps its order
                continue
            if "norm" in name:
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02, generator=gen)

    @property
    def block_bytes(self) -> int:
        """Bytes of K and V for one block across all layers, on this rank."""
        cfg = self.model_cfg
        elem = self.kv_spec.element_size
        return 2 * cfg.num_layers * self.block_size * self.num_kv_heads * cfg.head_dim * elem

    def allocate_cache(self, num_blocks: int) -> None:
        shape = (num_blocks, self.block_size, self.num_kv_heads, self.model_cfg.head_dim)
        dtype = self.kv_spec.torch_dtype
        self.kv_caches = [
            (torch.zeros(shape, dtype=dtype, device=self.device),
             torch.zeros(shape, dtype=dtype, device=self.device))
            for _ in range(self.model_cfg.num_layers)
        ]
        self.blocks = KVBlocks(self.kv_caches)

    @torch.inference_mode()
    def forward(self, batch: StepBatch, logit_calls: list[list[int]] = ()) -> torch.Tensor:
        """Hidden states ``[num_tokens, hidden]``. Then takes part in one
        logits computation per list of rows in ``logit_calls`` (a follower
        rank: rank 0 computes them itself and gets them)."""
        input_ids, positions, meta = batch.to_device(self.device)
        hidden = self.model(input_ids, positions, self.kv_caches, meta)
        for rows in logit_calls:
            self.model.compute_logits(hidden[rows])
        return hidden
