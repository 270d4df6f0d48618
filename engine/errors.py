"""Errors that say more than ``ValueError`` about the engine's own state."""

from __future__ import annotations


class EngineUnusable(RuntimeError):
    """The engine cannot run another step (a tensor-parallel rank is gone).
    A server should stop taking work and exit, so that it is restarted."""
