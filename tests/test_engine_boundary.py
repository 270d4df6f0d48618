"""The engine's public API is the only way in: callers outside the engine
core never reach its scheduler, KV cache manager, runner or output
processor, and the scheduler hands the runner plain data only."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

from engine import scheduler_output

ROOT = Path(__file__).resolve().parent.parent
# The engine's collaborators, private to LLMEngine.
INTERNALS = {"scheduler", "kv", "runner", "output_processor"}
CALLERS = ["engine/async_engine.py", "engine/warmup.py", "tandem", "worker", "prefill_service", "decode_service",
           "gateway", "kv_transfer"]


def _engine_internals_used(path: Path) -> list[str]:
    """``<x>.engine.<internal>`` / ``engine.<internal>`` attribute chains in a file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not (isinstance(node, ast.Attribute) and node.attr in INTERNALS):
            continue
        owner = node.value
        name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", "")
        if name in ("engine", "e"):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno} .{name}.{node.attr}")
    return found


def test_callers_use_only_the_engine_api():
    files = []
    for entry in CALLERS:
        p = ROOT / entry
        files += sorted(p.rglob("*.py")) if p.is_dir() else [p]
    assert len(files) > 10
    used = [hit for f in files for hit in _engine_internals_used(f)]
    assert not used, "callers reach into the engine: " + ", ".join(used)


def test_the_checker_sees_a_reach_in():
    bad = ROOT / "tests" / "_boundary_probe.py"
    try:
        bad.write_text("def f(self):\n    return self.engine.scheduler.running\n")
        assert _engine_internals_used(bad) == ["tests/_boundary_probe.py:2 .engine.scheduler"]
    finally:
        bad.unlink()


def test_scheduler_output_is_plain_data():
    """No Request objects or tensors cross from the scheduler to the runner."""
    allowed = {"str", "int", "bool", "list[int]", "list[list[int]]", "list[str]", "tuple[int, ...]",
               "SamplingParams", "list[NewRequestData]", "list[ScheduledRequest]",
               "dict[str, int]", "dict[str, list[int]]", "dict[str, dict[int, float]]",
               "dict[str, list[dict[int, float] | None]]"}
    for cls in (scheduler_output.NewRequestData, scheduler_output.ScheduledRequest,
                scheduler_output.SchedulerOutput, scheduler_output.ModelRunnerOutput):
        for f in dataclasses.fields(cls):
            assert f.type in allowed, f"{cls.__name__}.{f.name}: {f.type}"
