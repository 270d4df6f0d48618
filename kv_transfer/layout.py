"""The wire header of a KV handoff: what both ends must agree on."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from engine.config import KV_DTYPE_SIZES
from rpc.errors import LayoutMismatch
from rpc.protos import worker_pb2

WIRE_VERSION = 1
LAYOUT_NHD = "NHD"  # per layer, K then V, each [num_blocks, block_size, kv_heads, head_dim]


@dataclass(frozen=True)
class KVLayout:
    model_fingerprint: str
    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    layout: str = LAYOUT_NHD
    tp_rank_map: tuple[int, ...] = (0,)
    wire_version: int = WIRE_VERSION
    # What the blocks are stored in when not the model's ``dtype`` ("": that
    # dtype; peers from before the field send ""), and an fp8 cache's
    # per-tensor (k, v) scales (engine/kv_quant.py). Both ends must agree on
    # both: an fp8 block read with another dtype or scale is garbage.
    kv_cache_dtype: str = ""
    kv_scales: tuple[float, float] = (1.0, 1.0)

    def __post_init__(self) -> None:
        object.__setattr__(self, "kv_scales", tuple(float(x) for x in self.kv_scales))

    @property
    def cache_dtype(self) -> str:
        """The dtype the blocks travel in."""
        return self.kv_cache_dtype or self.dtype

    @property
    def block_bytes_per_layer(self) -> int:
        """K and V of one block in one layer."""
        elem = KV_DTYPE_SIZES[self.cache_dtype]
        return 2 * self.block_size * self.num_kv_heads * self.head_dim * elem

    def to_proto(self) -> worker_pb2.KVLayout:
        d = asdict(self)
        d["tp_rank_map"] = list(self.tp_rank_map)
        d["kv_scales"] = list(self.kv_scales)
        return worker_pb2.KVLayout(**d)

    @classmethod
    def from_proto(cls, p: worker_pb2.KVLayout) -> KVLayout:
        return cls(
            model_fingerprint=p.model_fingerprint, dtype=p.dtype, block_size=p.block_size,
            num_layers=p.num_layers, num_kv_heads=p.num_kv_heads, head_dim=p.head_dim,
            layout=p.layout, tp_rank_map=tuple(p.tp_rank_map), wire_version=p.wire_version,
            kv_cache_dtype=p.kv_cache_dtype,
            kv_scales=tuple(p.kv_scales) if len(p.kv_scales) == 2 else (1.0, 1.0),
        )

    def check_compatible(self, other: KVLayout, other_name: str = "peer") -> None:
        """Raise LayoutMismatch naming every field on which the two sides differ."""
        diffs = [
            f"{name}: this worker {mine!r}, {other_name} {theirs!r}"
            for name, mine, theirs in (
                (f.name, _shown(self, f.name), _shown(other, f.name)) for f in _fields()
            )
            if mine != theirs
        ]
        if diffs:
            raise LayoutMismatch("KV layout mismatch (" + "; ".join(diffs) + ")")


def _shown(layout: KVLayout, name: str):
    """A field as compared and reported: the cache dtype in full."""
    return layout.cache_dtype if name == "kv_cache_dtype" else getattr(layout, name)


def _fields():
    from dataclasses import fields

    return fields(KVLayout)


@dataclass
class TransferStats:
    transport: str
    bytes: int = 0
    seconds: float = 0.0
    extra: dict = field(default_factory=dict)
