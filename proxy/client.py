"""Terminal clients for trying a deployment: ``pd-proxy complete`` and ``pd-proxy chat``.

Plain httpx, no OpenAI SDK needed. Output goes to stdout, errors to stderr; a failed
request exits 1.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from typing import Any, TextIO

import httpx


class ClientError(Exception):
    pass


def _auth(args: argparse.Namespace) -> dict[str, str]:
    key = getattr(args, "api_key", None)
    return {"Authorization": f"Bearer {key}"} if key else {}


def _error_message(resp: httpx.Response) -> str:
    try:
        return str(resp.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return resp.text[:500] or f"HTTP {resp.status_code}"


def _sse_objects(resp: httpx.Response) -> Iterator[dict[str, Any]]:
    for line in resp.iter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        obj = json.loads(data)
        if "error" in obj:
            raise ClientError(str(obj["error"].get("message", obj["error"])))
        yield obj


def _describe(e: Exception, url: str) -> str:
    """The error line: a connection that never opened names the URL tried."""
    if isinstance(e, httpx.ConnectError | httpx.ConnectTimeout):
        return f"cannot reach {url}: {e} (is the proxy running there? --url sets it)"
    return str(e)


def _body(args: argparse.Namespace, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"max_tokens": args.max_tokens, "temperature": args.temperature}
    if args.model:
        body["model"] = args.model
    body.update(extra)
    return body


def stream_text(
    client: httpx.Client, path: str, body: dict[str, Any], out: TextIO, chat: bool
) -> str:
    """POST a streaming request, write text deltas to ``out`` as they come; return all text."""
    parts: list[str] = []
    with client.stream("POST", path, json={**body, "stream": True}) as resp:
        if resp.status_code != 200:
            resp.read()
            raise ClientError(f"HTTP {resp.status_code}: {_error_message(resp)}")
        for obj in _sse_objects(resp):
            for choice in obj.get("choices") or []:
                text = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
                if text:
                    parts.append(text)
                    out.write(text)
                    out.flush()
    return "".join(parts)


def run_complete(args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    with httpx.Client(base_url=args.url, timeout=args.timeout, headers=_auth(args)) as client:
        try:
            if args.stream:
                stream_text(client, "/v1/completions", _body(args, prompt=args.prompt), out, False)
                out.write("\n")
                return 0
            resp = client.post("/v1/completions", json=_body(args, prompt=args.prompt))
            if resp.status_code != 200:
                raise ClientError(f"HTTP {resp.status_code}: {_error_message(resp)}")
            out.write(resp.json()["choices"][0]["text"] + "\n")
            return 0
        except (ClientError, httpx.HTTPError) as e:
            sys.stderr.write(f"error: {_describe(e, args.url)}\n")
            return 1


def run_chat(args: argparse.Namespace, stdin: TextIO = sys.stdin, out: TextIO = sys.stdout) -> int:
    """A conversation: each stdin line is a user turn; the answer streams back."""
    messages: list[dict[str, str]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    interactive = stdin.isatty()
    status = 0
    with httpx.Client(base_url=args.url, timeout=args.timeout, headers=_auth(args)) as client:
        while True:
            if interactive:
                out.write("> ")
                out.flush()
            line = stdin.readline()
            if not line or line.strip() == "/exit":
                break
            text = line.rstrip("\n")
            if not text.strip():
                continue
            messages.append({"role": "user", "content": text})
            try:
                answer = stream_text(
                    client, "/v1/chat/completions", _body(args, messages=messages), out, True
                )
            except (ClientError, httpx.HTTPError) as e:
                messages.pop()
                sys.stderr.write(f"error: {_describe(e, args.url)}\n")
                status = 1
                continue
            out.write("\n")
            out.flush()
            messages.append({"role": "assistant", "content": answer})
    return status
