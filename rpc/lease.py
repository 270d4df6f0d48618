"""How long a decode worker holds blocks reserved for a prompt whose KV has
not arrived: the default both sides of the Reserve call agree on (the
gateway asks for it, plus time per prompt token; a worker given 0 uses it).
Said once here, where the gateway and the workers both import from."""

DEFAULT_LEASE_MS = 30_000
