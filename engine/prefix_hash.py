"""Block digests for the prefix cache: chained, collision-resistant, the same
in every process.

A prefix-cache hit hands a request the KV cache that another request
computed. If two different prefixes shared a key, the second prompt would be
served the first one's attention state: wrong output, and across users a
leak of what another prompt said. Python's ``hash()`` of a token tuple is no
safe key: it is 64 bits wide and built for speed, not to resist inputs crafted
to collide, so a collision can happen by chance and can be made on purpose.

A block's digest here is BLAKE2b-256 over its parent block's digest and its
own token ids packed as little-endian int64. It therefore covers every token
of the prefix up to the block's end, it is the same in every process and on
every machine (no PYTHONHASHSEED, no address of ``None``), and two prefixes
with one digest cannot be found.

The pool does not trust a digest alone either: a cached block keeps the bytes
its digest was computed from (``block_preimage``: the parent's digest and the
packed tokens) and a lookup compares them, so a key that collided or was cut
short would be a miss, never another prompt's KV.

Cost: about a microsecond per block; a 4096-token prompt in blocks of 16 (256
blocks) hashes in a few hundred microseconds.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence

DIGEST_SIZE = 32
# Domain separation: these digests mean "a KV block of Tandem's prefix cache".
_PERSON = b"tandem.kvprefix1"
# The parent of a prompt's first block: a digest no block has, so that the
# preimage is always a whole digest followed by the tokens.
_ROOT = bytes(DIGEST_SIZE)


def pack_tokens(token_ids: Sequence[int]) -> bytes:
    """Token ids as little-endian int64, whatever the machine's byte order."""
    packed = array("q", token_ids)
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


def block_preimage(parent: bytes | None, token_ids: Sequence[int]) -> bytes:
    """What a block's digest is computed from: the parent block's digest
    (None for a prompt's first block) and the block's token ids."""
    return (_ROOT if parent is None else parent) + pack_tokens(token_ids)


def digest(preimage: bytes) -> bytes:
    return hashlib.blake2b(preimage, digest_size=DIGEST_SIZE, person=_PERSON).digest()


def hash_block(parent: bytes | None, token_ids: Sequence[int]) -> bytes:
    """The digest of one block: it covers every token before the block too."""
    return digest(block_preimage(parent, token_ids))


def hash_blocks(parent: bytes | None, token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """The digests of the full blocks of ``token_ids``, chained from ``parent``
    (packs the tokens once, not once per block)."""
    packed = pack_tokens(token_ids)
    width = 8 * block_size
    out = []
    for start in range(0, len(packed) - width + 1, width):
        parent = digest((_ROOT if parent is None else parent) + packed[start : start + width])
        out.append(parent)
    return out
