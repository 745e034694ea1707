"""Bad tier options are refused at construction with a ConfigError that names the option."""
from __future__ import annotations

import math

import pytest

from kvserve import LLM
from kvserve.config import CacheConfig
from kvserve.errors import ConfigError


def _llm(**kw):
    return LLM("dummy:tiny", show_progress=False, kv_cache_memory="4MiB", **kw)


@pytest.mark.parametrize("url", ["http://127.0.0.1:6379", "memcached://127.0.0.1:11211", "127.0.0.1:6379",
                                 "redis:/127.0.0.1", "redis://", "", " redis://127.0.0.1:6379", "redis://a b"])
def test_bad_redis_url(url):
    with pytest.raises(ConfigError) as e:
        _llm(redis_url=url)
    assert e.value.option == "redis_url" and str(e.value).startswith("redis_url:")


@pytest.mark.parametrize("url", ["redis://127.0.0.1:1/0", "rediss://127.0.0.1:1", "unix:///tmp/nothing.sock"])
def test_good_redis_url_shapes_are_accepted(url):
    CacheConfig(redis_url=url)


@pytest.mark.parametrize("option,value", [
    ("cpu_kv_memory", -1), ("cpu_kv_memory", "-1GiB"), ("cpu_kv_memory", "lots"), ("cpu_kv_memory", -0.5),
    ("disk_kv_size", 0), ("disk_kv_size", "0"), ("disk_kv_size", "0MiB"), ("disk_kv_size", -5),
    ("disk_kv_size", "-1GiB"), ("disk_kv_size", "big"),
])
def test_bad_sizes(option, value, tmp_path):
    with pytest.raises(ConfigError) as e:
        _llm(disk_kv_dir=str(tmp_path / "kv"), **{option: value})
    assert e.value.option == option and option in str(e.value)
    assert not (tmp_path / "kv").exists()  # refused before anything was created


@pytest.mark.parametrize("field,value", [("cpu_kv_memory", -1), ("disk_kv_size", 0), ("disk_kv_size", -1)])
def test_bad_sizes_in_cache_config(field, value):
    with pytest.raises(ConfigError) as e:
        CacheConfig(disk_kv_dir="/nonexistent/kv", **{field: value})
    assert e.value.option == field


@pytest.mark.parametrize("value", [0, 0.0, -1, -0.5, math.nan])
def test_bad_idle_offload_seconds(value):
    with pytest.raises(ConfigError) as e:
        _llm(cpu_kv_memory="8MiB", idle_offload_seconds=value)
    assert e.value.option == "idle_offload_seconds" and "idle_offload_seconds" in str(e.value)


@pytest.mark.parametrize("tiers", [{"cpu_kv_memory": "8MiB"}, {"disk_kv_dir": "DIR"}, {"redis_url": "redis://127.0.0.1:1"}],
                         ids=["cpu", "disk", "redis"])
def test_tiers_need_prefix_caching(tiers, tmp_path):
    tiers = {k: str(tmp_path / "kv") if v == "DIR" else v for k, v in tiers.items()}
    with pytest.raises(ConfigError) as e:
        _llm(enable_prefix_caching=False, **tiers)
    (name,) = tiers
    assert name in e.value.option and "prefix caching" in str(e.value)


def test_tiers_off_by_default_and_zero_cpu_means_off():
    assert not CacheConfig().tiers_enabled
    llm = _llm(cpu_kv_memory=0)
    assert llm.engine.store is None
    assert _llm(cpu_kv_memory="0").engine.store is None
    assert _llm(enable_prefix_caching=False).engine.store is None  # no tiers: no conflict


def test_valid_tier_options_build_a_store(tmp_path):
    llm = _llm(cpu_kv_memory="8MiB", disk_kv_dir=str(tmp_path / "a" / "b"), disk_kv_size="16MiB",
               idle_offload_seconds=0.25)
    st = llm.engine.store
    assert st.cpu.capacity == 8 * 2**20 and st.disk.capacity == 16 * 2**20
    assert (tmp_path / "a" / "b").is_dir()  # created
    assert llm.engine.config.cache.idle_offload_seconds == 0.25


def test_redis_url_without_the_redis_package(monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, "redis", None)  # "import redis" raises ImportError
    with pytest.raises(ConfigError) as e:
        _llm(redis_url="redis://127.0.0.1:1/0")
    assert e.value.option == "redis_url" and "redis" in str(e.value)


@pytest.mark.parametrize("field,value", [
    ("kv_tier_secret", ""), ("kv_tier_secret", "fifteen chars.."), ("kv_tier_secret", 2**64),
    ("kv_tier_secret", b"sixteen bytes..."), ("kv_tier_encrypt", 1), ("kv_tier_encrypt", "yes"),
    ("kv_tier_encrypt", None),
])
def test_bad_tier_secret_and_encrypt(field, value):
    with pytest.raises(ConfigError) as e:
        CacheConfig(disk_kv_dir="/nonexistent/kv", **{field: value})
    assert e.value.option == field and field in str(e.value)


def test_tier_secret_stays_out_of_the_config_repr():
    from kvserve.config import EngineConfig
    cache = CacheConfig(disk_kv_dir="/nonexistent/kv", kv_tier_secret="a very private tier secret")
    assert "very private" not in repr(cache) and "very private" not in repr(EngineConfig(cache=cache))
