"""KVTransferParams: parsed once where a request enters, typed after that."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from engine.core.request import Request
from engine.sampling_params import InvalidRequestError, SamplingParams
from engine.server.protocol import parse_completion_request
from engine.server.request_fields import APIError
from kvconnector.params import KVTransferParams

P_LEG = {"do_remote_decode": True, "transfer_id": "t1"}
D_LEG = {
    "do_remote_prefill": True,
    "transfer_id": "t1",
    "remote_side_channel": "tcp://10.0.0.1:5600",
    "skip_first_token": True,
}
P_ANSWER = {
    "transfer_id": "t1",
    "first_token": 42,
    "remote_engine_id": "p-0",
    "remote_side_channel": "tcp://10.0.0.1:5600",
}


@pytest.mark.parametrize("wire", [P_LEG, D_LEG, P_ANSWER, {}])
def test_round_trip_keeps_the_wire_keys(wire):
    params = KVTransferParams.from_dict(wire)
    assert params.to_dict() == wire
    assert KVTransferParams.from_dict(params.to_dict()) == params


def test_typed_fields():
    d = KVTransferParams.from_dict(D_LEG)
    assert d.do_remote_prefill and not d.do_remote_decode and d.disaggregated
    assert d.remote_side_channel == "tcp://10.0.0.1:5600" and d.skip_first_token
    assert not KVTransferParams.from_dict(P_ANSWER).disaggregated
    assert KVTransferParams.from_dict({"transfer_id": None}) == KVTransferParams()  # null: unset


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        ({"do_remote_decode": 1}, "do_remote_decode"),
        ({"do_remote_decode": "true"}, "do_remote_decode"),
        ({"do_remote_prefill": 0, "remote_side_channel": "tcp://h:1"}, "do_remote_prefill"),
        ({"transfer_id": 7}, "transfer_id"),
        ({"transfer_id": ""}, "transfer_id"),
        ({"transfer_id": "t" * 257}, "transfer_id"),  # a side-channel name is bounded
        ({"do_remote_prefill": True}, "remote_side_channel"),
        ({"do_remote_prefill": True, "remote_side_channel": 5}, "remote_side_channel"),
        ({"do_remote_prefill": True, "remote_side_channel": "http://h:1"}, "remote_side_channel"),
        # A decode leg names the transfer: its own id is unique, no prefill leg knows it.
        ({"do_remote_prefill": True, "remote_side_channel": "tcp://h:1"}, "transfer_id"),
        ({"first_token": -1}, "first_token"),
        ({"first_token": True}, "first_token"),
        ({"first_token": 1.0}, "first_token"),
        ({"skip_first_token": "yes"}, "skip_first_token"),
        ({"remote_engine_id": 3}, "remote_engine_id"),
        ({"do_remote_decod": True}, "do_remote_decod"),
        ({**P_LEG, **D_LEG}, "do_remote_prefill"),
    ],
)
def test_bad_fields_are_refused_with_the_field_named(raw, field):
    with pytest.raises(InvalidRequestError) as info:
        KVTransferParams.from_dict(raw)
    assert info.value.param == f"kv_transfer_params.{field}"
    assert f"kv_transfer_params.{field}" in str(info.value) or "both" in str(info.value)


@pytest.mark.parametrize("raw", ["x", [P_LEG], 3, None])
def test_not_an_object(raw):
    with pytest.raises(InvalidRequestError, match="must be an object") as info:
        KVTransferParams.from_dict(raw)
    assert info.value.param == "kv_transfer_params"


def test_direct_construction_is_validated_too():
    with pytest.raises(InvalidRequestError, match="transfer_id"):
        KVTransferParams(transfer_id=3)  # type: ignore[arg-type]


def test_http_layer_parses_once_and_names_the_field():
    req = parse_completion_request({"prompt": "x", "kv_transfer_params": D_LEG})
    assert req.kv_transfer_params == KVTransferParams.from_dict(D_LEG)
    with pytest.raises(APIError) as info:
        parse_completion_request({"prompt": "x", "kv_transfer_params": {"transfer_id": 1}})
    assert info.value.param == "kv_transfer_params.transfer_id"
    assert info.value.status_code == 400


def test_request_carries_the_typed_params_and_the_transfer_id_fallback():
    sp = SamplingParams()
    assert Request("r1", [1], sp).transfer_id == "r1"
    p = KVTransferParams(do_remote_decode=True)
    assert Request("r1", [1], sp, kv_transfer_params=p).transfer_id == "r1"
    p = KVTransferParams(do_remote_decode=True, transfer_id="t")
    assert Request("r1", [1], sp, kv_transfer_params=p).transfer_id == "t"
    with pytest.raises(TypeError, match="KVTransferParams.from_dict"):
        Request("r1", [1], sp, kv_transfer_params=P_LEG)  # type: ignore[arg-type]


def test_the_module_does_not_import_torch():
    code = "import kvconnector.params, proxy.app, sys; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_connector_policy_is_applied_once_at_admission():
    from engine.config import EngineConfig, ModelConfig
    from engine.kv_cache_layout import KVCacheSpec
    from engine.model.config import load_arch_config
    from kvconnector.base import transfer_seed
    from kvconnector.noop import NoopConnectorScheduler

    config = EngineConfig(model=ModelConfig(dtype="float32"))
    spec = KVCacheSpec.for_model(load_arch_config("tiny"), config)

    class Moving(NoopConnectorScheduler):
        moves_kv = True

    sampled = SamplingParams(max_tokens=9, temperature=1.0)
    p = Request("p", [1, 2], sampled, kv_transfer_params=KVTransferParams.from_dict(P_LEG))
    Moving(config, spec).prepare_request(p)
    assert p.sampling_params.max_tokens == 1  # P samples only the first token
    assert p.sampling_params.seed == transfer_seed("t1")
    d = Request("d", [1, 2], sampled, kv_transfer_params=KVTransferParams.from_dict(D_LEG))
    Moving(config, spec).prepare_request(d)
    assert d.sampling_params.max_tokens == 9 and d.sampling_params.seed == transfer_seed("t1")
    seeded = Request("s", [1], SamplingParams(seed=5), kv_transfer_params=KVTransferParams())
    Moving(config, spec).prepare_request(seeded)
    assert seeded.sampling_params.seed == 5

    with pytest.raises(InvalidRequestError, match="--kv-connector nixl"):
        NoopConnectorScheduler(config, spec).prepare_request(p)
    # A decode node's leg alone (no KV to move) is seeded by its transfer id too: a stream
    # the proxy moves to another node replays it with that seed.
    local = Request("l", [1], sampled, kv_transfer_params=KVTransferParams(transfer_id="x"))
    NoopConnectorScheduler(config, spec).prepare_request(local)  # nothing to move: fine
    assert local.sampling_params == dataclasses.replace(sampled, seed=transfer_seed("x"))
    plain = Request("n", [1], sampled)  # no transfer parameters: a client's own request
    NoopConnectorScheduler(config, spec).prepare_request(plain)
    assert plain.sampling_params == sampled
