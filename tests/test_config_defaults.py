"""Engine defaults are said once, in the config dataclasses: every field has a
command-line flag and an ``engine_config`` keyword, and their defaults are the
field's. Also the one dtype table."""

from __future__ import annotations

import argparse
import inspect
from dataclasses import MISSING, fields

import pytest

from engine.cli_args import add_engine_args, config_from_args
from engine.config import (
    DTYPE_SIZES,
    DTYPES,
    CacheConfig,
    EngineConfig,
    SchedulerConfig,
    default_of,
)
from tandem.llm import engine_config

CONFIGS = (EngineConfig, CacheConfig, SchedulerConfig)
# The nested configs: their own fields are checked one by one instead.
NOT_SETTINGS = {"cache", "scheduler"}
# Flags whose spelling is not the field's name: field -> (dest, field value of the flag's default).
RENAMED_FLAGS = {"kv_cache_bytes": ("kv_cache_gib", lambda gib: int(gib * (1 << 30)))}


def settings() -> list[tuple[type, str]]:
    return [(cls, f.name) for cls in CONFIGS for f in fields(cls) if f.name not in NOT_SETTINGS]


def has_default(cls: type, name: str) -> bool:
    f = cls.__dataclass_fields__[name]
    return f.default is not MISSING or f.default_factory is not MISSING


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return parser.parse_args(argv)


def test_field_names_do_not_overlap_between_the_configs():
    names = [name for _, name in settings()]
    assert len(names) == len(set(names))


@pytest.mark.parametrize("cls,name", settings(), ids=lambda x: getattr(x, "__name__", x))
def test_every_field_has_a_flag_defaulting_to_the_field(cls, name):
    args = parse([])
    dest, to_field = RENAMED_FLAGS.get(name, (name, lambda v: v))
    assert hasattr(args, dest), f"{cls.__name__}.{name} has no command-line flag"
    if has_default(cls, name):
        assert to_field(getattr(args, dest)) == default_of(cls, name)


@pytest.mark.parametrize("cls,name", settings(), ids=lambda x: getattr(x, "__name__", x))
def test_every_field_is_an_engine_config_keyword_defaulting_to_the_field(cls, name):
    params = inspect.signature(engine_config).parameters
    assert name in params, f"{cls.__name__}.{name} is no keyword of engine_config"
    if has_default(cls, name):
        assert params[name].default == default_of(cls, name)


def test_engine_config_takes_no_keyword_that_is_not_a_field():
    names = {name for _, name in settings()}
    assert set(inspect.signature(engine_config).parameters) <= names


def test_defaults_build_the_default_config():
    expected = EngineConfig(model=None)  # type: ignore[arg-type]
    assert config_from_args(parse([])) == expected
    assert engine_config() == expected


def test_flags_reach_the_config():
    config = config_from_args(parse([
        "--dtype", "bfloat16", "--load-format", "dummy", "--max-n", "3", "--kv-cache-gib", "0.5",
        "--no-prefix-caching", "--enforce-eager", "--block-size", "8", "-tp", "2",
    ]))
    assert (config.dtype, config.load_format, config.enforce_eager) == ("bfloat16", "dummy", True)
    assert config.tensor_parallel_size == 2
    assert config.scheduler.max_n == 3
    assert config.cache.kv_cache_bytes == 1 << 29
    assert (config.cache.enable_prefix_caching, config.cache.block_size) == (False, 8)


def test_default_of_refuses_unknown_fields_and_required_ones():
    with pytest.raises(AttributeError):
        default_of(CacheConfig, "no_such_field")
    with pytest.raises(ValueError):
        default_of(EngineConfig, "model")


def test_one_dtype_table():
    torch = pytest.importorskip("torch")
    from engine.dtypes import TORCH_DTYPES, cpu_has_native_bf16, resolve_dtype, torch_dtype

    assert tuple(TORCH_DTYPES) == DTYPES
    for name, size in DTYPE_SIZES.items():
        assert torch_dtype(name) is getattr(torch, name) and torch_dtype(name).itemsize == size
    with pytest.raises(ValueError):
        torch_dtype("int8")
    assert parse([]).dtype == "auto"
    assert resolve_dtype("auto", "cpu") == ("bfloat16" if cpu_has_native_bf16() else "float32")
    assert resolve_dtype("float16", "cpu") == "float16"
    with pytest.raises(ValueError):
        resolve_dtype("float64", "cpu")
    with pytest.raises(SystemExit):
        parse(["--dtype", "float64"])
