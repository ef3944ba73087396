#!/usr/bin/env python3
"""Send one disaggregated request by hand: P prefills, D decodes (streamed to stdout).

Does what the proxy does for one request, with no proxy: reads P's side-channel address
from ``GET /v1/kv_transfer_info``, sends both legs at once with one request id, streams
D's answer.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import uuid

import httpx


async def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--prefill", required=True, help="prefill node URL")
    ap.add_argument("--decode", required=True, help="decode node URL")
    ap.add_argument("--prompt", default="Hello")
    ap.add_argument("--max-tokens", type=int, default=16)
    args = ap.parse_args()
    rid = f"pd-{uuid.uuid4().hex[:12]}"
    async with httpx.AsyncClient(timeout=120) as client:
        info = (await client.get(f"{args.prefill}/v1/kv_transfer_info")).json()
        if not info.get("side_channel"):
            print("the prefill node has no KV connector (--kv-connector nixl)", file=sys.stderr)
            return 1
        body = {"prompt": args.prompt, "max_tokens": args.max_tokens, "temperature": 0}
        headers = {"X-Request-Id": rid}
        p_body = {**body, "kv_transfer_params": {"do_remote_decode": True, "transfer_id": rid}}
        d_body = {
            **body,
            "stream": True,
            "kv_transfer_params": {
                "do_remote_prefill": True,
                "transfer_id": rid,
                "remote_side_channel": info["side_channel"],
            },
        }
        p_task = asyncio.create_task(
            client.post(f"{args.prefill}/v1/completions", json=p_body, headers=headers)
        )
        print(args.prompt, end="", flush=True)
        async with client.stream(
            "POST", f"{args.decode}/v1/completions", json=d_body, headers=headers
        ) as resp:
            if resp.status_code != 200:
                print(f"\ndecode node answered {resp.status_code}: {await resp.aread()}")
                return 1
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    print(f"\nerror: {chunk['error']['message']}", file=sys.stderr)
                    return 1
                print(chunk["choices"][0]["text"], end="", flush=True)
        p_resp = await p_task
        print(f"\n[request {rid}: prefill answered {p_resp.status_code}]")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
