"""``--kv-transport nixl|ucxx``: the flag, its check, the compatibility rule, and that the
optional ``ucxx`` is never imported unless a UCXX transport is built. In-process, no ucxx
needed (the transport's own tests are ``tests/test_ucxx_transport.py``)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from engine.config import ConfigError, KVTransferConfig
from kvconnector.nixl.messages import COMPAT_KEYS, check_compat


def test_the_default_transport_is_nixl():
    assert KVTransferConfig().kv_transport == "nixl"
    assert KVTransferConfig(kv_connector="nixl").kv_transport == "nixl"


def test_ucxx_without_ucxx_installed_is_refused_naming_the_flag(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "ucxx" else real(name, *a)
    )
    with pytest.raises(ConfigError, match=r"--kv-transport: ucxx is not installed"):
        KVTransferConfig(kv_connector="nixl", kv_transport="ucxx")
    # Without a connector the transport is never used: nothing to refuse.
    assert KVTransferConfig(kv_transport="ucxx").kv_transport == "ucxx"


def test_the_cli_flag_parses_and_refuses_other_values(capsys):
    import argparse

    from engine.server.cli_args import add_config_args

    parser = add_config_args(argparse.ArgumentParser(), [KVTransferConfig])
    assert parser.parse_args(["--kv-transport", "ucxx"]).kv_transport == "ucxx"
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-transport", "tcp"])
    assert "--kv-transport: invalid choice: 'tcp'" in capsys.readouterr().err


def test_a_nixl_peer_and_a_ucxx_peer_do_not_pair():
    assert COMPAT_KEYS[:2] == ("connector_version", "kv_transport")
    msg = check_compat(
        {"connector_version": 5, "kv_transport": "ucxx", "layout": "a"},
        {"connector_version": 5, "kv_transport": "nixl", "layout": "b"},
    )
    assert msg is not None
    assert msg.startswith("kv_transport mismatch: this node has 'ucxx', the peer has 'nixl'")
    assert "--kv-transport" in msg


def test_importing_the_package_never_imports_ucxx():
    code = (
        "import sys\n"
        "import kvconnector.nixl.transport_ucxx, kvconnector.nixl.worker\n"
        "import kvconnector.nixl.scheduler, engine.engine_core, engine.config\n"
        "assert not [m for m in sys.modules if m.split('.')[0] == 'ucxx'], 'ucxx imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
