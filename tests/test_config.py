from __future__ import annotations

import dataclasses

import pytest

from pagedserve import config as cfg
from pagedserve.config import ConfigError, EngineConfig, from_flat


def test_every_config_class_is_frozen() -> None:
    for cls in (cfg.ModelConfig, cfg.CacheConfig, cfg.ParallelConfig, cfg.SchedulerConfig,
                cfg.EngineConfig):
        inst = cls()
        field = dataclasses.fields(inst)[0].name
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(inst, field, getattr(inst, field))


@pytest.mark.parametrize(
    ("kwargs", "field", "fragment"),
    [
        ({"block_size": 0}, "block_size", "[1, 1024]"),
        ({"block_size": 24}, "block_size", "power of two"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization", "(0, 1]"),
        ({"allocation_policy": "greedy"}, "allocation_policy", "paged, reserve"),
        ({"tensor_parallel_size": 2, "decode_context_parallel_size": 4},
         "decode_context_parallel_size", "divide"),
        ({"max_num_seqs": 0}, "max_num_seqs", ">= 1"),
        ({"num_scheduler_steps": 0}, "num_scheduler_steps", ">= 1"),
        ({"num_scheduler_steps": 2.5}, "num_scheduler_steps", "integer"),
        ({"dtype": "int8"}, "dtype", "auto"),
        ({"kv_cache_dtype": "fp8"}, "kv_cache_dtype", "auto, bfloat16, fp8_e4m3"),
        ({"kv_cache_dtype": "float16"}, "kv_cache_dtype", "'float16'"),
        ({"calculate_kv_scales": 1}, "calculate_kv_scales", "bool"),
        ({"max_model_len": -5}, "max_model_len", ">= 1"),
        ({"placement_strategy": "RANDOM"}, "placement_strategy", "SPREAD"),
        ({"block_size": 16, "dcp_interleave": 3}, "dcp_interleave", "divide"),
        ({"no_such_option": 1}, "no_such_option", "unknown"),
    ],
)
def test_bad_values_name_field_and_range(kwargs: dict, field: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        from_flat(**kwargs)
    assert info.value.field == field
    assert fragment in str(info.value)


def test_flat_options_land_in_their_sections() -> None:
    c = from_flat(model="/m", block_size=32, tensor_parallel_size=2, max_num_seqs=8)
    assert (c.model.model, c.cache.block_size, c.parallel.tensor_parallel_size) == ("/m", 32, 2)
    assert c.scheduler.max_num_seqs == 8
    c2 = c.replace(cache={"block_size": 8})
    assert c2.cache.block_size == 8 and c.cache.block_size == 32
    assert isinstance(c2, EngineConfig)


def test_config_error_survives_pickling() -> None:
    import pickle

    err = pickle.loads(pickle.dumps(ConfigError("block_size", "must be a power of two")))
    assert err.field == "block_size" and str(err) == "block_size: must be a power of two"
