"""Drive a prefill EngineCore and a decode EngineCore in one test process.

Both engines are real: worker processes, real NIXL agents over UCX, real side channel.
The test thread steps them alternately, as each node's engine loop would.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace

from engine.config import EngineConfig, KVTransferConfig
from engine.core.request import Request
from engine.engine_core import EngineCore
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from kvconnector.params import KVTransferParams


def nixl_config(base: EngineConfig, role: str, **kv: object) -> EngineConfig:
    return replace(
        base,
        kv_transfer=KVTransferConfig(kv_connector="nixl", kv_role=role, **kv),  # type: ignore[arg-type]
    )


def run_until(
    engines: list[EngineCore],
    done: Callable[[], bool],
    on_output: Callable[[EngineCore, RequestOutput], None],
    timeout: float = 120.0,
) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            raise TimeoutError("engines did not finish in time")
        idle = True
        for eng in engines:
            if eng.has_work():
                outputs, n = eng.step()
                idle = idle and n == 0
                for out in outputs:
                    on_output(eng, out)
        if idle:
            time.sleep(0.001)


def disagg_generate(
    p: EngineCore,
    d: EngineCore,
    prompts: list[list[int]],
    params: SamplingParams,
    tag: str = "r",
    d_params: dict | None = None,
    submit_prefill: bool = True,
    timeout: float = 120.0,
    reserve_first: bool = False,
    cache_salt: str | None = None,
) -> dict[str, RequestOutput | list[int]]:
    """P prefills, D decodes. Returns per D request: tokens, and the final output.
    ``cache_salt``: both legs' (as the proxy forwards a client's to both).

    ``reserve_first``: D's requests go first, and P's only once every reservation reached
    P (P then knows where to write before its prefill step: a pipelined push)."""
    tokens: dict[str, list[int]] = {}
    final: dict[str, RequestOutput] = {}
    tids = [f"{tag}{i}-{time.monotonic_ns()}" for i in range(len(prompts))]

    def submit_p(tid: str, prompt: list[int]) -> None:
        p.add_request(
            Request(
                f"p-{tid}",
                prompt,
                replace(params, max_tokens=1),
                kv_transfer_params=KVTransferParams(do_remote_decode=True, transfer_id=tid),
                cache_salt=cache_salt,
            )
        )

    for tid, prompt in zip(tids, prompts, strict=True):
        if submit_prefill and not reserve_first:
            submit_p(tid, prompt)
        rid = f"d-{tid}"
        tokens[rid] = []
        d.add_request(
            Request(
                rid,
                prompt,
                params,
                kv_transfer_params=KVTransferParams.from_dict(
                    {
                        "do_remote_prefill": True,
                        "transfer_id": tid,
                        "remote_side_channel": p.connector.address,
                        **(d_params or {}),
                    }
                ),
                cache_salt=cache_salt,
            )
        )

    if submit_prefill and reserve_first:
        early = p.connector.producer.early
        run_until([d], lambda: len(early) >= len(prompts), lambda e, o: None, timeout)
        for tid, prompt in zip(tids, prompts, strict=True):
            submit_p(tid, prompt)

    def on_output(eng: EngineCore, out: RequestOutput) -> None:
        if eng is d:
            tokens[out.request_id].extend(out.new_token_ids)
            if out.finished:
                final[out.request_id] = out

    run_until([p, d], lambda: len(final) == len(tokens), on_output, timeout)
    # Let P finish its sends and free its blocks.
    run_until([p, d], lambda: not p.has_work() and not d.has_work(), lambda e, o: None, timeout)
    return {"tokens": [tokens[r] for r in tokens], "final": [final[r] for r in tokens]}


def assert_pools_full(*engines: EngineCore) -> None:
    """Every KV block of each engine is free again (nothing held, quarantined or leaked)."""
    for eng in engines:
        s = eng.stats()
        assert s["kv_blocks_free"] == s["kv_blocks_total"], s
