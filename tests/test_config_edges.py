"""Configuration values and backend URLs at their edges: bad input is refused with a ConfigError
that says what to write, never accepted silently."""

from __future__ import annotations

import json

import pytest

from kvflow.backends import open_backend
from kvflow.backends.arena.config import ArenaConfig
from kvflow.backends.local.config import LocalConfig
from kvflow.backends.memory import MemoryConfig
from kvflow.backends.mooncake.config import MooncakeConfig
from kvflow.config import parse_size
from kvflow.errors import ConfigError
from kvflow.integrations.vllm.config import ConnectorConfig

# --- parse_size -----------------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["4ib", "4i", "4 I", "256iB"])
def test_size_with_a_stray_i_is_a_config_error_saying_what_to_write(text: str) -> None:
    """An "i" without a unit letter is not a size (it was a bare ValueError)."""
    with pytest.raises(ConfigError, match="size"):
        parse_size(text)


@pytest.mark.parametrize(
    "url",
    ["memory://?capacity=4ib", "local:///tmp/x?capacity=4ib", "arena:///tmp/x?slot=4ib"],
)
def test_backend_url_with_a_stray_i_size_is_a_config_error(url: str) -> None:
    parse = {"memory": MemoryConfig, "local": LocalConfig, "arena": ArenaConfig}[url.split(":")[0]]
    with pytest.raises(ConfigError, match="size"):
        parse.from_url(url)


def test_connector_size_with_a_stray_i_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"max_inflight_bytes|size"):
        ConnectorConfig.from_extra_config({"max_inflight_bytes": "4ib"})


def test_a_huge_size_is_a_config_error_not_an_overflow() -> None:
    with pytest.raises(ConfigError):
        parse_size("1" + "0" * 400)


def test_an_integer_size_in_text_is_read_exactly() -> None:
    """A large integer is read exactly (not through a float, which loses the low bits above 2**53)."""
    assert parse_size(str(2**54 + 1)) == 2**54 + 1


def test_a_fraction_of_a_byte_is_not_silently_dropped() -> None:
    """``capacity=1.5`` (bytes) is refused, not read as 1 without a word."""
    with pytest.raises(ConfigError):
        parse_size("1.5")


def test_sizes_read_as_documented() -> None:
    assert parse_size("256MiB") == 256 << 20
    assert parse_size("1GB") == 10**9
    assert parse_size("1.5GiB") == 3 << 29
    assert parse_size(" 4 KiB ") == 4096
    assert parse_size("0") == 0
    for bad in ("-1", "", "1e9", ".5", "4.", True, 4.0, -3, None):
        with pytest.raises(ConfigError):
            parse_size(bad)  # type: ignore[arg-type]


# --- URLs -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("url", ["local:////", "local:///%2F", "arena:////"])
def test_the_root_directory_is_refused_however_it_is_spelled(url: str) -> None:
    """store_path refuses "/" ("an absolute directory below /") by ``normpath(value) == "/"``, but
    POSIX normpath keeps a leading "//", so "//" (the root) passes."""
    parse = LocalConfig if url.startswith("local") else ArenaConfig
    with pytest.raises(ConfigError, match="below /"):
        parse.from_url(url)


@pytest.mark.parametrize("url", ["local:///tmp/my\tstore", "local:///tmp/my\nstore"])
def test_control_characters_in_a_path_are_not_silently_dropped(url: str) -> None:
    """urlsplit deletes tab, CR and LF anywhere in the URL: the store opens in /tmp/mystore."""
    try:
        config = LocalConfig.from_url(url)
    except ConfigError:
        return
    assert config.path == url[len("local://") :], f"{url!r} opened the store at {config.path!r}"


def test_open_backend_refuses_a_non_text_url_with_a_config_error() -> None:
    with pytest.raises(ConfigError):
        open_backend(5)  # type: ignore[arg-type]


_REFUSED_URLS = [
    "local:///tmp/a?capacty=1GiB",
    "local:///tmp/a?capacity=1GiB&capa%63ity=2GiB",
    "local:///tmp/a#frag",
    "local://host/tmp/a",
    "local:tmp/a",
    "local:///tmp/a?capacity",
    "local:///tmp/a?lock_timeout=nan",
    "local:///tmp/a/../..",
    "memory:///",
    "memory://?cap=1",
    "memory://?capacity=0",
    "memory://host",
    "mooncake://127.0.0.1:50051?hard_pin=maybe",
    "mooncake://127.0.0.1:50051?device_memory=True",
    "mooncake://127.0.0.1:50051?replicas=1.5",
    "mooncake://127.0.0.1:50051?segment=1MiB",
    "mooncake://127.0.0.1:0",
    "mooncake://u@127.0.0.1:1",
    "mooncake://10.0.0.5:50051",
    "mooncake://127.0.0.1:50051/path",
    "mooncake://127.0.0.1:50051?metrics_port=70000",
    "mooncake://127.0.0.1:50051?segment=4ib",
    "mooncake://[example.com]:50051",
    "mooncake://[::1:50051",
]


@pytest.mark.parametrize("url", _REFUSED_URLS)
def test_a_url_with_a_typo_a_duplicate_or_a_bad_value_is_refused(url: str) -> None:
    parse = {"local": LocalConfig, "memory": MemoryConfig, "mooncake": MooncakeConfig}[url.split(":")[0]]
    with pytest.raises(ConfigError):
        parse.from_url(url)


def test_urls_read_as_documented() -> None:
    assert LocalConfig.from_url("local:///tmp/a%20b%3Fc%23d").path == "/tmp/a b?c#d"
    for url in ("foo://", "", "memory", "/dev/shm/x"):
        with pytest.raises(ConfigError, match="use one of"):
            open_backend(url)
    assert MooncakeConfig.from_url("mooncake://[::1]").master == "[::1]:50051"
    assert MooncakeConfig.from_url("mooncake://127.0.0.1:1?hard_pin=false").hard_pin is False
    assert MooncakeConfig.from_url("mooncake://127.0.0.1:1?hard_pin=0").hard_pin is False


# --- Mooncake -------------------------------------------------------------------------------------


@pytest.mark.parametrize("param", ["hard_pin", "prefer_same_node"])
def test_a_bare_mooncake_flag_does_not_silently_read_as_false(param: str) -> None:
    """``?hard_pin`` written bare is refused, not read as False."""
    with pytest.raises(ConfigError, match=f"write {param}=true or {param}=false"):
        MooncakeConfig.from_url(f"mooncake://127.0.0.1:50051?{param}")


def test_an_empty_check_present_does_not_silently_turn_it_off() -> None:
    with pytest.raises(ConfigError, match="check_present"):
        MooncakeConfig.from_url("mooncake://127.0.0.1:50051?check_present=")


@pytest.mark.parametrize("master", ["::1:50051", "[::1:50051", "::1]:50051", "[127.0.0.1]:50051", "[]:50051"])
def test_an_ipv6_master_must_be_bracketed(master: str) -> None:
    """``::1:50051`` is ambiguous (it read as host ``::1``, port 50051, and ``::1:5`` as ``::1``
    port 5 or ``::`` port 1:5); only ``[IPv6]:PORT`` is taken, with an IPv6 address inside."""
    with pytest.raises(ConfigError, match=r"in brackets"):
        MooncakeConfig(master=master)


def test_a_bracketed_ipv6_master_is_taken() -> None:
    config = MooncakeConfig.from_url("mooncake://[::1]:7000")
    assert (config.master, config.master_host) == ("[::1]:7000", "::1")
    assert MooncakeConfig.from_mapping({"master_server_address": "[::1]:7001"}).master == "[::1]:7001"


def test_a_null_master_in_mooncake_json_is_refused() -> None:
    """``"master_server_address": null`` is no master (it would fall back to 127.0.0.1:50051)."""
    with pytest.raises(ConfigError, match="master_server_address"):
        MooncakeConfig.from_mapping({"master_server_address": None})


# --- vLLM connector config ------------------------------------------------------------------------

# vLLM reads --kv-transfer-config with json.loads, which takes NaN and Infinity.
_NAN, _INF = json.loads("NaN"), json.loads("Infinity")


@pytest.mark.parametrize("key", ["lookup_wait_s", "load_wait_s", "load_idle_wait_s"])
@pytest.mark.parametrize("value", [_NAN, _INF])
def test_connector_seconds_must_be_finite(key: str, value: float) -> None:
    """JSON lets NaN and Infinity through: infinite waits would overflow (every lookup answered
    "failed", get_finished raising) and NaN would switch the waits off."""
    with pytest.raises(ConfigError, match=key):
        ConnectorConfig.from_extra_config({key: value})


def test_connector_config_refuses_what_it_cannot_use() -> None:
    for extra in (
        {"layerwise": "false"},
        {"load_async": 0},
        {"backend": "memory://"},
        {"backend": "Memory://"},
        {"backend": "/dev/shm/x"},
        {"max_inflight_bytes": "0"},
        {"staging": "AUTO"},
        {"model_id": ""},
        {"layerwise_depth": 2.0},
        {"unknown": 1},
        {"lookup_backend": "memory://"},
    ):
        with pytest.raises(ConfigError):
            ConnectorConfig.from_extra_config(extra)
