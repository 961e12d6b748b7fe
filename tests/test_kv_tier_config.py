"""The tier's configuration (ion_vllm/kv_tier/config.py): the keys it reads, their
defaults and validation, and the refusal of unknown and removed keys, each with a message
that names the key and what to do instead.  The spec raises these at start-up, before any
engine allocates memory."""

import dataclasses

import pytest

from ion_vllm.kv_tier.config import KEYS, REMOVED_KEYS, VLLM_KEYS, KVTierConfig

BASE = {"cpu_bytes_to_use": 1 << 30}


def parse(**kw):
    return KVTierConfig.from_extra_config({**BASE, **kw})


def test_defaults_and_the_key_count():
    c = parse()
    assert c == KVTierConfig(host_bytes=1 << 30)
    assert (c.ring_mib, c.ring_bytes, c.max_inflight_mib) == (256.0, 256 << 20, None)
    assert c.offload_prompt_only is False and c.verify is False
    assert len(KEYS) <= 6 and set(KEYS).isdisjoint(VLLM_KEYS)
    assert set(KEYS).isdisjoint(REMOVED_KEYS) and set(VLLM_KEYS).isdisjoint(REMOVED_KEYS)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.verify = True


def test_every_key_is_read():
    c = parse(cpu_bytes_to_use="2147483648", ring_mib="64", max_inflight_mib=512.5,
              offload_prompt_only="true", verify=1)
    assert c == KVTierConfig(host_bytes=2 << 30, ring_mib=64.0, max_inflight_mib=512.5,
                             offload_prompt_only=True, verify=True)
    # vLLM's --kv-offloading-size hands a float byte count
    assert parse(cpu_bytes_to_use=1.5 * (1 << 30)).host_bytes == 3 << 29
    assert parse(ring_mib=0).ring_bytes == 0  # no ring: every block copied directly
    assert parse(verify="off", offload_prompt_only=False).verify is False
    assert parse(ring_mib=None, verify=None) == parse()  # JSON null: the default
    # vLLM's own keys pass through
    assert KVTierConfig.from_extra_config({**BASE, **{k: "x" for k in VLLM_KEYS}}) == parse()


@pytest.mark.parametrize("key,value,msg", [
    ("cpu_bytes_to_use", 0, "byte count > 0"),
    ("cpu_bytes_to_use", -5, "byte count > 0"),
    ("cpu_bytes_to_use", 0.5, "byte count > 0"),
    ("cpu_bytes_to_use", "lots", "must be a number"),
    ("cpu_bytes_to_use", True, "must be a number"),
    ("cpu_bytes_to_use", float("inf"), "finite"),
    ("ring_mib", -1, "'ring_mib' must be >= 0"),
    ("ring_mib", "big", "'ring_mib' must be a number"),
    ("ring_mib", float("nan"), "'ring_mib' must be finite"),
    ("max_inflight_mib", 0, "'max_inflight_mib' must be > 0"),
    ("max_inflight_mib", -64, "'max_inflight_mib' must be > 0"),
    ("max_inflight_mib", [64], "'max_inflight_mib' must be a number"),
    ("offload_prompt_only", "maybe", "'offload_prompt_only' must be true or false"),
    ("offload_prompt_only", 2, "'offload_prompt_only' must be true or false"),
    ("verify", "yes please", "'verify' must be true or false"),
    ("verify", 0.5, "'verify' must be true or false"),
])
def test_bad_values_are_refused_naming_the_key(key, value, msg):
    with pytest.raises(ValueError, match=msg):
        KVTierConfig.from_extra_config({**BASE, key: value})


def test_the_host_size_is_required():
    with pytest.raises(ValueError, match="cpu_bytes_to_use.*ION_KV_TIER_GB"):
        KVTierConfig.from_extra_config({"ring_mib": 64})


def test_direct_construction_is_validated_too():
    with pytest.raises(ValueError, match="cpu_bytes_to_use"):
        KVTierConfig(host_bytes=0)
    with pytest.raises(ValueError, match="ring_mib"):
        KVTierConfig(host_bytes=1, ring_mib=-0.5)
    with pytest.raises(ValueError, match="verify"):
        KVTierConfig(host_bytes=1, verify="true")


def test_an_unknown_key_is_refused_naming_the_allowed_keys():
    with pytest.raises(ValueError) as e:
        parse(ring_size=64)
    msg = str(e.value)
    assert "unknown kv_connector_extra_config key 'ring_size'" in msg
    assert all(k in msg for k in KEYS)


@pytest.mark.parametrize("key", sorted(REMOVED_KEYS))
def test_a_removed_key_is_refused_with_what_to_do_instead(key):
    with pytest.raises(ValueError) as e:
        parse(**{key: "anything"})
    msg = str(e.value)
    assert f"'{key}' was removed" in msg and "drop the key" in msg
    if key == "host_gib":
        assert "cpu_bytes_to_use" in msg and "--kv-offloading-size" in msg
    elif key.startswith("host_delay") or key == "ring_idle":
        assert "test-only" in msg
    elif key != "issue_api":
        assert "the tier now always does what its default did" in msg


def test_every_lab_key_is_either_kept_or_removed():
    """The lab version's kv_connector_extra_config keys (spec.py at tag lab-2026-12): each
    is read, passed to vLLM or refused as removed; none becomes merely unknown."""
    lab = ("cpu_bytes_to_use host_gib ring_mib max_inflight_mib offload_prompt_only copier "
           "ring_overflow store_completion host_layout ring_gather load_copy issue_at "
           "id_upload issue_api gather_priority drain_chunk_kib ring_max_job_blocks "
           "gather_stream gather_ids store_batch_blocks store_batch_steps host_delay_us "
           "host_delay_at ring_idle verify").split()
    assert len(lab) == 25
    assert all(k in KEYS or k in REMOVED_KEYS for k in lab)


def test_sizes_derived_from_the_config():
    c = KVTierConfig(host_bytes=100 * (1 << 20) + 5, ring_mib=8)
    assert c.host_blocks(2 << 20) == 50 and c.host_blocks(0) == 0
    assert c.window_blocks(1 << 20, world=2) == 32  # 4 x 8 MiB ring / 1 MiB blocks
    assert KVTierConfig(host_bytes=1 << 30, max_inflight_mib=3).window_blocks(1 << 20, 1) == 3
    assert KVTierConfig(host_bytes=1 << 30, max_inflight_mib=0.1).window_blocks(1 << 20, 1) == 1
