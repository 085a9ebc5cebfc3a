"""KVCacheConfig validation and pool sizing."""

import pytest
import torch

from mstar.engines.base import KVLayout
from mstar.engines.kv_cache.config import CPU_DEFAULT_POOL_BYTES, KVCacheConfig, compute_num_pages, page_bytes

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float16)


def test_explicit_page_count_wins():
    assert compute_num_pages(KVCacheConfig(max_num_pages=7), LAYOUT, "cpu") == 7


def test_cpu_default_budget():
    per_page = page_bytes(LAYOUT, 16)
    assert per_page == 2 * 2 * 16 * 2 * 8 * 2
    assert compute_num_pages(KVCacheConfig(), LAYOUT, "cpu") == CPU_DEFAULT_POOL_BYTES // per_page


@pytest.mark.parametrize("kwargs, match", [
    ({"max_num_pages": 0}, "max_num_pages=0"),
    ({"page_size": 0}, "page_size=0"),
    ({"memory_fraction": 1.5}, "memory_fraction=1.5"),
    ({"memory_fraction": 0.0}, "memory_fraction=0.0"),
    ({"attention_backend": ""}, "attention_backend"),
])
def test_invalid_values_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        KVCacheConfig(**kwargs)


def test_the_yaml_section_rejects_unknown_keys():
    from mstar.config import config_from_dict

    assert config_from_dict({"model": "toy", "kv_cache": {"page_size": 32}}).kv_cache.page_size == 32
    with pytest.raises(ValueError, match="page_sise"):
        config_from_dict({"model": "toy", "kv_cache": {"page_sise": 32}})
