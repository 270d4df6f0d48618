"""Llama-family decoder (Llama, Mistral, Qwen2) over a flattened, paged batch.

Tokens of all sequences in a step are one flat batch ``[num_tokens, ...]``;
where each token's keys and values live is in the attention metadata.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from engine.attention import AttentionBackend, AttentionMetadata
from engine.config import ModelConfig
from engine.layers.activation import silu_and_mul
from engine.layers.embedding import VocabParallelEmbedding, vocab_logits
from engine.layers.linear import linear
from engine.layers.norm import RMSNorm
from engine.layers.packed import PackedWeight
from engine.layers.rotary import RotaryEmbedding
from engine.parallel import TensorParallel

KVCache = tuple[torch.Tensor, torch.Tensor]  # (k_cache, v_cache) of one layer


class Attention(nn.Module):
    """Self-attention over this rank's heads: q/k/v are split by heads across
    tensor-parallel ranks (column-parallel), o_proj by its inputs
    (row-parallel), and the ranks' partial outputs are summed."""

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, rotary: RotaryEmbedding,
                 tp: TensorParallel):
        super().__init__()
        self.num_heads = tp.split(cfg.num_heads, "num_attention_heads")
        self.num_kv_heads = tp.split(cfg.num_kv_heads, "num_key_value_heads")
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        quant, fused = cfg.quantization, backend.fused_layers
        qkv_out = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
        self.qkv_proj = linear(cfg.hidden_size, qkv_out, cfg.qkv_bias, quant, fused, tp, "column")
        self.o_proj = linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, False, quant, fused,
                             tp, "row")
        self.tp = tp
        self.rotary = rotary
        self.backend = backend
        self.scale = self.head_dim**-0.5

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)  # [num_tokens, num_heads, head_dim]
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(positions, q, k)
        out = self.backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)
        return self.tp.all_reduce(self.o_proj(out.reshape(-1, self.q_size)))


class MLP(nn.Module):
    """SwiGLU over this rank's share of the intermediate columns."""

    def __init__(self, cfg: ModelConfig, fused: bool, tp: TensorParallel):
        super().__init__()
        quant, inner = cfg.quantization, cfg.intermediate_size
        tp.split(inner, "intermediate_size")  # ValueError unless the ranks share it evenly
        self.gate_up_proj = linear(cfg.hidden_size, 2 * inner, False, quant, fused, tp, "column")
        self.down_proj = linear(inner, cfg.hidden_size, False, quant, fused, tp, "row")
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.down_proj(silu_and_mul(self.gate_up_proj(x))))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, rotary: RotaryEmbedding,
                 tp: TensorParallel):
        super().__init__()
        fused = backend.fused_layers
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, fused)
        self.self_attn = Attention(cfg, backend, rotary, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, fused)
        self.mlp = MLP(cfg, fused, tp)

    def forward(self, x, residual, positions, kv_cache, meta):
        # h = x + attn(norm(x)); out = h + mlp(norm(h)), with the adds fused into the norms.
        x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, positions, kv_cache, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaForCausalLM(nn.Module):
    """The decoder on one tensor-parallel rank. The embeddings and the LM
    head are split by vocabulary rows; norms are whole on every rank."""

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, max_position: int,
                 tp: TensorParallel):
        super().__init__()
        self.config = cfg
        self.tp = tp
        rotary = RotaryEmbedding(cfg.head_dim, max_position, cfg.rope_theta, cfg.rope_scaling,
                                 fused=backend.fused_layers)
        # The layers first: their head counts are the likelier misfit to report.
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, backend, rotary, tp) for _ in range(cfg.num_layers)
        )
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, backend.fused_layers)
        self.lm_head = None if cfg.tie_word_embeddings else linear(
            cfg.hidden_size, cfg.vocab_size, False, None, False, tp, "column"
        )
        # A tied head multiplies by the embedding table: its own packed copy.
        self.head_packed = PackedWeight() if self.lm_head is None else self.lm_head.packed
        # Called with each layer's index once it stored its KV, during steps
        # that stream a prompt's KV by layer (engine/layer_streams.py sets it).
        self.on_layer_done: Callable[[int], None] | None = None

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden]
        x, residual = self.embed_tokens(input_ids), None
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            x, residual = layer(x, residual, positions, kv_cache, meta)
            if self.on_layer_done is not None:
                self.on_layer_done(i)
        return self.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Logits of ``hidden``'s rows on rank 0 (their dtype: ``vocab_logits``);
        every rank calls it with the same rows (with tensor parallelism each
        scores its slice of the vocabulary), the others get None."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return vocab_logits(hidden, weight, self.tp, self.head_packed)

    # ---- weights ---------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load Hugging Face checkpoint names, merging q/k/v and gate/up into
        the fused projections (quantized layers convert each tensor first).
        Every required parameter must be loaded exactly once per shard."""
        params = dict(self.named_parameters())
        modules = dict(self.named_modules())
        fused = {  # HF name part -> (our name part, index of the shard)
            "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
            "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
        }
        loaded: dict[str, set[int | None]] = {}  # parameter -> the shards it has
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if "rotary_emb" in name or (name == "lm_head.weight" and self.lm_head is None):
                continue
            parts = name.split(".")
            target, shard = name, None
            for i, part in enumerate(parts):
                if part in fused:
                    our, shard = fused[part]
                    target = ".".join(parts[:i] + [our] + parts[i + 1 :])
            owner, _, leaf = target.rpartition(".")
            if hasattr(modules.get(owner), "checkpoint_tensor"):
                converted = modules[owner].checkpoint_tensor(leaf, tensor)
                if converted is None:  # only checked (compressed-tensors' weight_shape)
                    continue
                leaf, tensor = converted
                target = f"{owner}.{leaf}"
            if target not in params:
                raise ValueError(f"checkpoint tensor {name!r} matches no parameter of the model")
            self._load_shard(params[target], name, target, shard, tensor, target in loaded)
            loaded.setdefault(target, set()).add(shard)
        missing = sorted(
            n for n, p in params.items()
            if not getattr(p, "optional", False)
            and len(loaded.get(n, ())) != (3 if "qkv_proj" in n else 2 if "gate_up" in n else 1)
        )
        if missing:
            raise ValueError(f"checkpoint is missing weights, e.g. {missing[:3]}")

    @torch.no_grad()
    def _load_shard(self, param: nn.Parameter, name: str, target: str, shard: int | None,
                    tensor: torch.Tensor, seen: bool) -> None:
        """Copy one checkpoint tensor into its parameter, or into the slice of
        output features its shard of a fused projection owns. ``seen``: another
        shard already filled this parameter."""
        if getattr(param, "broadcast_scalar", False) and tensor.numel() == 1:
            # A per-tensor scale (compressed-tensors) fills every row of its shard.
            offset, size = self._shard_range(target, shard, param.shape[0])
            param.narrow(0, offset, size).fill_(tensor.reshape(()).item())
            return
        tp_dim = getattr(param, "tp_dim", None)
        if tp_dim is not None and self.tp.size > 1:  # this rank's slice of the checkpoint
            tensor = tensor.chunk(self.tp.size, dim=tp_dim)[self.tp.rank]
        dim = getattr(param, "output_dim", 0)
        dst = param
        if shard is not None and dim is not None:
            offset, size = self._shard_range(target, shard, param.shape[dim])
            dst = param.narrow(dim, offset, size)
        elif seen and dim is None and not torch.equal(param, tensor.to(param.dtype)):
            # Per-input-row data (g_idx) is shared by the fused shards.
            raise ValueError(f"checkpoint tensor {name!r} differs between the fused shards")
        if tensor.shape != dst.shape:
            raise ValueError(
                f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                f"expected {tuple(dst.shape)}"
            )
        dst.copy_(tensor)

    def _shard_range(self, target: str, shard: int | None, rows: int) -> tuple[int, int]:
        if shard is None:
            return 0, rows
        cfg, tp = self.config, self.tp.size
        if "qkv_proj" in target:
            q, kv = cfg.num_heads // tp * cfg.head_dim, cfg.num_kv_heads // tp * cfg.head_dim
            return [(0, q), (q, kv), (q + kv, kv)][shard]
        half = rows // 2
        return shard * half, half
