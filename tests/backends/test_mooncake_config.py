"""Mooncake settings that used to be accepted and misread, or refused for no reason (no Mooncake
needed: configuration only)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvflow.backends.mooncake.config import MooncakeConfig, parse_mooncake_size
from kvflow.errors import ConfigError


@pytest.mark.parametrize(
    ("url", "words"),
    [
        ("mooncake://127.0.0.1:\u0665\u0660\u0660\u0665\u0661", "HOST:PORT"),  # Arabic-Indic digits
        ("mooncake://127.0.0.1:50051?max_batch=1_000", "max_batch='1_000'.*digits 0-9"),
        ("mooncake://127.0.0.1:50051?concurrency=%2B4", "concurrency=.\\+4.*digits 0-9"),
        ("mooncake://127.0.0.1:50051?max_batch=%207%20", "max_batch=' 7 '.*digits 0-9"),
        ("mooncake://127.0.0.1:50051?replicas=\u0662", "replicas=.*digits 0-9"),
        ("mooncake://127.0.0.1:50051?segment=\u0661\u0666MiB", "segment=.*not a size"),
        ("mooncake://127.0.0.1:50051?protocol=nonsense", "protocol 'nonsense'.*tcp.*rdma"),
        ("mooncake://127.0.0.1:50051?protocol=%20tcp", "protocol ' tcp'.*lowercase"),
        ("mooncake://127.0.0.1:50051?protocol=TCP", "protocol 'TCP'"),
        ("mooncake://127.0.0.1:50051?protocol=", "protocol ''"),
        ("mooncake://127.0.0.1:50051?probe_timeout=1e-9", "probe_timeout_s.*from 0.01 to 86400"),
        ("mooncake://127.0.0.1:50051?setup_timeout=0.001", "setup_timeout_s.*from 0.01"),
        ("mooncake://127.0.0.1:50051?timeout=1e300", "timeout_s.*to 86400"),
        ("mooncake://127.0.0.1:50051?close_timeout=1e10", "close_timeout_s.*to 86400"),
        ("mooncake://127.0.0.1:50051?health_interval=1e300", "health_interval_s.*at most 86400"),
    ],
)
def test_values_that_were_misread_are_refused_naming_what_is_accepted(url: str, words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        MooncakeConfig.from_url(url)


def test_the_bounds_themselves_and_every_mooncake_protocol_are_accepted() -> None:
    cfg = MooncakeConfig.from_url(
        "mooncake://127.0.0.1:50051?probe_timeout=0.01&timeout=86400&health_interval=0.001&max_batch=0007"
    )
    assert (cfg.probe_timeout_s, cfg.timeout_s, cfg.health_interval_s, cfg.max_batch) == (
        0.01,
        86400,
        0.001,
        7,
    )
    for protocol in ("tcp", "rdma", "ascend", "nvlink", "efa", "barex"):
        assert MooncakeConfig(protocol=protocol).protocol == protocol


@pytest.mark.parametrize(
    ("text", "words"),
    [("0.5", "whole number of bytes"), ("1.9b", "whole number"), ("1.0000000001GB", "whole")],
)
def test_a_json_size_that_is_not_a_whole_number_of_bytes_is_refused(
    text: str, words: str, tmp_path: Path
) -> None:
    """ "0.5" used to read as 0 (a pure client, silently) and "1.9b" as 1."""
    path = tmp_path / "mooncake.json"
    path.write_text(json.dumps({"master_server_address": "127.0.0.1:50051", "global_segment_size": text}))
    with pytest.raises(ConfigError, match=f"global_segment_size.*{words}"):
        MooncakeConfig.from_file(path)
    assert parse_mooncake_size("0.5GB", name="x") == 1 << 29  # a fraction of a unit that is whole
    with pytest.raises(ConfigError):
        parse_mooncake_size("\u0661GB", name="x")


@pytest.mark.parametrize(
    "master", ["LOCALHOST:50051", "127.1:50051", "127.0.0.2:50051", "[::ffff:127.0.0.1]:50051", "[::1]:50051"]
)
def test_every_spelling_of_loopback_is_a_local_master(master: str) -> None:
    """A local master needs no local_hostname; these used to demand one."""
    assert MooncakeConfig(master=master).client_hostname == "127.0.0.1"


@pytest.mark.parametrize(
    "master", ["127.0.0.1x:50051", "0.0.0.0:50051", "10.0.0.5:50051", "[::ffff:10.0.0.1]:1"]
)
def test_other_hosts_still_need_local_hostname(master: str) -> None:
    with pytest.raises(ConfigError, match="local_hostname"):
        MooncakeConfig(master=master)
