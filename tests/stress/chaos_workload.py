"""The chaos suite's workload: prompts, the request mix (``Spec``), one client's request
and how it ended (``Result``), and the check of an answer against the colocated
reference."""

from __future__ import annotations

import hashlib
import json
import random
import time
from collections.abc import Collection
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx
from chaos_config import STRUCTURED, STRUCTURED_CHECKS, ChaosConfig, RefKey
from chaos_responses import ResponsesStream, body_outcome, responses_body
from harness import (
    GREEDY,
    MODEL,
)

# -- the workload ---------------------------------------------------------------------------


_TEXT = """
the of and to in is was for on that with as by at from his it an were are which this be
river game home place state number best great old large line public last right city court
stone road hill lake forest sea wind rain snow sun moon star sky cloud fire earth metal
wood glass paper cloth bread milk fruit seed tree flower grass leaf root branch animal
"""
WORDS = _TEXT.split()


def make_prompts(
    n: int, rng: random.Random, long_bytes: tuple[int, int] = (300, 1400)
) -> list[str]:
    """``n`` prompts: a third short (~10-60 bytes), a third medium (~150-400), a third long
    (~900-2000, the long ones share a 600-byte prefix in pairs: prefix-cache hits on D)."""

    def text(nbytes: int) -> str:
        words: list[str] = []
        while sum(len(w) + 1 for w in words) < nbytes:
            words.append(rng.choice(WORDS))
        return " ".join(words)

    prompts = []
    shared = [text(600) for _ in range(max(1, n // 6))]
    for i in range(n):
        kind = i % 3
        if kind == 0:
            prompts.append(text(rng.randint(10, 60)))
        elif kind == 1:
            prompts.append(text(rng.randint(150, 400)))
        else:
            prompts.append(shared[(i // 3) % len(shared)] + " " + text(rng.randint(*long_bytes)))
    return prompts


@dataclass
class Spec:
    """One client request of the workload."""

    index: int
    round: int
    prompt: int  # index into the prompt pool
    chat: bool
    stream: bool
    max_tokens: int
    label: str
    abort: tuple[str, float] | None  # ("events", k) or ("after_s", t): the client leaves
    burst: bool = False  # part of a fault's long-prompt burst
    structured: int = -1  # an index into STRUCTURED; -1: none
    responses: bool = False  # a chat as POST /v1/responses (checked against the chat's answer)
    tenant: int = -1  # ``--tenants``: whose request (-1: no tenant, no salt, no key)
    salt: str | None = None  # the tenant's ``cache_salt`` (None: unsalted)
    cache_key: str | None = None  # the conversation's ``prompt_cache_key``

    @property
    def ref_key(self) -> RefKey:
        return (self.prompt, self.chat, self.max_tokens, self.structured)


@dataclass
class Result:
    index: int
    round: int
    label: str
    chat: bool
    stream: bool
    max_tokens: int
    prompt_len: int
    planned_abort: str | None
    outcome: str = "pending"  # completed | errored | aborted | hung | broken
    status: int | None = None
    error: str | None = None
    tokens: int = 0
    wrong: bool = False
    wrong_detail: str | None = None
    elapsed_s: float = 0.0
    burst: bool = False
    ref_key: RefKey = (0, False, 0, -1)
    finish: str | None = None  # a completed answer's finish reason
    ids: list[int] = field(default_factory=list, repr=False)  # what the client got
    text: str = field(default="", repr=False)
    responses: bool = False  # asked as /v1/responses: no token ids, checked by its text
    tenant: int = -1
    # ``--tenants``: the usage's cached prompt tokens (None: no usage seen), its prompt
    # tokens, and when the request was sent and ended (monotonic seconds).
    cached: int | None = None
    prompt_tokens: int | None = None
    t_start: float = 0.0
    t_end: float = 0.0
    isolation: str | None = None  # what the tenant isolation check found wrong

    @classmethod
    def of(cls, spec: Spec, prompt_len: int, planned_abort: str | None, **kw: Any) -> Result:
        """The result of ``spec``'s request, before it ran."""
        return cls(
            spec.index, spec.round, spec.label, spec.chat, spec.stream, spec.max_tokens,
            prompt_len, planned_abort, ref_key=spec.ref_key, responses=spec.responses,
            tenant=spec.tenant, **kw,
        )  # fmt: skip

    def public(self) -> dict[str, Any]:
        d = asdict(self)
        d["ids"], d["text"] = d["ids"][:16], d["text"][:80]
        return d


def make_specs(
    cfg: ChaosConfig,
    rng: random.Random,
    round_no: int,
    start: int,
    n: int,
    num_prompts: int,
    long_only: bool = False,
) -> list[Spec]:
    specs = []
    for i in range(start, start + n):
        prompt = rng.randrange(num_prompts)
        if long_only:
            prompt = rng.choice([k for k in range(num_prompts) if k % 3 == 2])
        stream = rng.random() < 0.5
        abort = None
        if rng.random() < cfg.abort_rate:
            if stream and rng.random() < 0.6:
                abort = ("events", float(rng.randint(0, 6)))
            else:
                abort = ("after_s", round(rng.uniform(0.02, 2.0), 3))
        if rng.random() < cfg.reuse_rate:
            label = f"dup-{rng.randrange(3)}"
        else:
            label = f"chaos-r{round_no}-{i}"
        structured = -1
        if cfg.structured_rate > 0 and rng.random() < cfg.structured_rate:  # draws only then:
            structured = rng.randrange(len(STRUCTURED))  # a seed's plain workload stays
        specs.append(
            Spec(
                i,
                round_no,
                prompt,
                rng.random() < 0.15,
                stream,
                rng.choice(cfg.max_tokens),
                label,
                abort,
                burst=long_only,
                structured=structured,
            )
        )
        # Draws only with a share set (a seed's workload without it stays the same).
        if cfg.responses_rate > 0 and rng.random() < cfg.responses_rate:
            spec = specs[-1]
            if spec.structured < 0 or "response_format" in STRUCTURED[spec.structured]:
                spec.chat = spec.responses = True
        if cfg.tenants > 0:  # draws only then (a seed's workload without tenants stays)
            spec = specs[-1]
            spec.tenant = rng.randrange(cfg.tenants)
            spec.salt = None if cfg.tenant_unsalted else tenant_salt(cfg.seed, spec.tenant)
            spec.cache_key = f"t{spec.tenant}-{conversation(spec.prompt, num_prompts)}"
    return specs


def tenant_salt(seed: int, tenant: int) -> str:
    """Tenant ``tenant``'s ``cache_salt`` (a secret per tenant, as vLLM suggests; here
    derived from the seed, so a run can be repeated)."""
    return hashlib.sha256(f"chaos-tenant-{seed}-{tenant}".encode()).hexdigest()[:43]


def conversation(prompt: int, num_prompts: int) -> str:
    """The conversation a prompt of the pool belongs to (``make_prompts``): the long
    prompts after one shared prefix are one conversation, every other prompt its own."""
    if prompt % 3 == 2:
        return f"shared-{(prompt // 3) % max(1, num_prompts // 6)}"
    return f"prompt-{prompt}"


def tenant_fields(spec: Spec) -> dict[str, Any]:
    """A tenant's request's extra fields: its salt and its conversation's key."""
    if spec.tenant < 0:
        return {}
    out: dict[str, Any] = {"prompt_cache_key": spec.cache_key}
    if spec.salt is not None:
        out["cache_salt"] = spec.salt
    return out


def body_of(spec: Spec, prompts: list[str]) -> dict[str, Any]:
    if spec.responses:
        body = responses_body(prompts[spec.prompt], spec.max_tokens, spec.stream, spec.structured)
        return {**body, **tenant_fields(spec)}
    body = {"model": MODEL, "max_tokens": spec.max_tokens, **GREEDY, **tenant_fields(spec)}
    if spec.chat:
        body["messages"] = [{"role": "user", "content": prompts[spec.prompt]}]
    else:
        body["prompt"] = prompts[spec.prompt]
    if spec.stream:
        body["stream"] = True
        if spec.tenant >= 0:  # the usage (its cached tokens) in the last chunk
            body["stream_options"] = {"include_usage": True}
    if spec.structured >= 0:
        body.update(STRUCTURED[spec.structured])
    return body


def path_of(spec: Spec) -> str:
    if spec.responses:
        return "/v1/responses"
    return "/v1/chat/completions" if spec.chat else "/v1/completions"


def choice_text(choice: dict[str, Any], chat: bool) -> str:
    if not chat:
        return choice.get("text") or ""
    part = choice.get("message") or choice.get("delta") or {}
    return part.get("content") or ""


def compute_references(
    url: str,
    keys: set[RefKey],
    prompts: list[str],
    refs: dict[RefKey, tuple[list[int], str]],
    concurrency: int = 8,
) -> None:
    """The colocated node's answer (token ids, text) of every request shape in ``keys``
    not in ``refs`` yet. Greedy answers do not depend on when they are computed, so this
    runs after a round (the reference node idles during the chaos)."""
    keys = sorted(set(keys) - set(refs))

    def one(key: RefKey) -> None:
        spec = Spec(0, 0, key[0], key[1], False, key[2], "chaos-ref", None, structured=key[3])
        resp = httpx.post(url + path_of(spec), json=body_of(spec, prompts), timeout=300)
        resp.raise_for_status()
        (choice,) = resp.json()["choices"]
        # ignore_eos: only a grammar ends an answer before max_tokens.
        ends = ("length", "stop") if key[3] >= 0 else ("length",)
        assert choice["finish_reason"] in ends, choice
        refs[key] = (list(choice["token_ids"]), choice_text(choice, key[1]))

    with ThreadPoolExecutor(concurrency) as pool:
        for f in [pool.submit(one, k) for k in keys]:
            f.result()


def run_request(proxy_url: str, spec: Spec, prompts: list[str], deadline_s: float) -> Result:
    r = Result.of(
        spec,
        len(prompts[spec.prompt]),
        f"{spec.abort[0]}={spec.abort[1]}" if spec.abort else None,
        burst=spec.burst,
    )
    start = r.t_start = time.monotonic()
    ids: list[int] = []
    text = ""
    usage: Any = None  # the answer's usage (a stream's: its usage chunk's)
    leave_after_s = spec.abort[1] if spec.abort and spec.abort[0] == "after_s" else None
    leave_after_events = int(spec.abort[1]) if spec.abort and spec.abort[0] == "events" else None
    read_timeout = leave_after_s if leave_after_s is not None else deadline_s
    timeout = httpx.Timeout(read_timeout, connect=10, write=10, pool=10)
    headers = {"X-Request-Id": spec.label}
    url = proxy_url + path_of(spec)
    try:
        with (
            httpx.Client(timeout=timeout) as client,
            client.stream("POST", url, json=body_of(spec, prompts), headers=headers) as resp,
        ):
            r.status = resp.status_code
            if not spec.stream or resp.status_code != 200:
                raw = _read_within(resp, start, leave_after_s, deadline_s)
                if spec.responses and resp.status_code == 200:
                    r.outcome, detail, text = body_outcome(json.loads(raw))
                    r.finish, r.error = (
                        (detail, None) if r.outcome == "completed" else (None, detail)
                    )
                    if r.outcome == "completed":
                        usage = json.loads(raw).get("usage")
                else:
                    _classify_body(r, resp.status_code, raw, spec.chat, ids_out=ids)
                    if r.outcome == "completed":
                        text = _json_text(raw, spec.chat)
                        usage = json.loads(raw).get("usage")
            elif spec.responses:
                text, usage = _read_responses_stream(r, resp, start, deadline_s, leave_after_s,
                                                     leave_after_events)  # fmt: skip
            else:
                events = 0
                finish = None
                ended = False
                for line in resp.iter_lines():
                    if time.monotonic() - start > deadline_s:
                        r.outcome, r.error = "hung", f"stream still open after {deadline_s}s"
                        break
                    if leave_after_s is not None and time.monotonic() - start > leave_after_s:
                        r.outcome = "aborted"
                        break
                    if not line:
                        continue
                    if not line.startswith("data: "):
                        r.outcome, r.error = "broken", f"not an SSE data line: {line[:80]!r}"
                        break
                    data = line[6:]
                    if data == "[DONE]":
                        ended = True
                        break
                    try:
                        ev = json.loads(data)
                    except ValueError:
                        r.outcome, r.error = "broken", f"event not JSON: {data[:80]!r}"
                        break
                    if "error" in ev:
                        r.outcome = "errored"
                        err = ev["error"] or {}
                        r.error = f"event {err.get('code')}: {str(err.get('message'))[:160]}"
                        continue  # [DONE] must follow
                    if ev.get("usage") is not None:
                        usage = ev["usage"]
                    for c in ev.get("choices", []):
                        ids.extend(c.get("token_ids") or [])
                        text += choice_text(c, spec.chat)
                        finish = c.get("finish_reason") or finish
                    events += 1
                    if leave_after_events is not None and events >= leave_after_events:
                        r.outcome = "aborted"
                        break
                if r.outcome == "pending":
                    if not ended:
                        r.outcome, r.error = "broken", "stream ended without [DONE]"
                    elif finish in ("length", "stop"):
                        r.outcome, r.finish = "completed", finish
                    else:
                        r.outcome, r.error = "errored", f"stream finished with {finish!r}"
                elif r.outcome == "errored" and not ended:
                    r.outcome = "broken"
                    r.error = (r.error or "") + " (no [DONE] after the error event)"
    except httpx.TimeoutException as e:
        if leave_after_s is not None and time.monotonic() - start < deadline_s:
            r.outcome = "aborted"
        else:
            r.outcome, r.error = "hung", f"{type(e).__name__} after {time.monotonic() - start:.0f}s"
    except httpx.HTTPError as e:
        r.outcome, r.error = "broken", f"{type(e).__name__}: {e}"[:200]
    r.t_end = time.monotonic()
    r.elapsed_s = round(r.t_end - start, 2)
    r.tokens = len(ids)
    r.ids, r.text = ids, text
    if spec.tenant >= 0 and r.outcome == "completed":
        _read_usage(r, usage)
    return r


def _read_usage(r: Result, usage: Any) -> None:
    """A tenant's completed answer's cached and prompt tokens (from its usage, which
    every answer has: a stream's by ``stream_options.include_usage``)."""
    responses = r.responses
    details = "input_tokens_details" if responses else "prompt_tokens_details"
    prompt = usage.get("input_tokens" if responses else "prompt_tokens") if usage else None
    if not isinstance(prompt, int):
        r.outcome, r.error = "broken", f"completed without a usage: {str(usage)[:120]}"
        return
    cached = (usage.get(details) or {}).get("cached_tokens") or 0
    if not isinstance(cached, int) or not 0 <= cached <= prompt:
        r.outcome, r.error = "broken", f"usage's cached_tokens {cached!r} of {prompt} prompt tokens"
        return
    r.cached, r.prompt_tokens = cached, prompt


def _read_responses_stream(
    r: Result,
    resp: httpx.Response,
    start: float,
    deadline_s: float,
    leave_after_s: float | None,
    leave_after_events: int | None,
) -> tuple[str, Any]:
    """A /v1/responses stream read into ``r`` (as a chat stream is); its text and its
    final response's usage."""
    stream, events = ResponsesStream(), 0
    for line in resp.iter_lines():
        if time.monotonic() - start > deadline_s:
            r.outcome, r.error = "hung", f"stream still open after {deadline_s}s"
            return stream.text, stream.usage
        if leave_after_s is not None and time.monotonic() - start > leave_after_s:
            r.outcome = "aborted"
            return stream.text, stream.usage
        if not line or line.startswith("event: "):
            continue
        wrong = stream.feed(line[6:]) if line.startswith("data: ") else f"not SSE: {line[:80]!r}"
        if wrong is not None:
            r.outcome, r.error = "broken", wrong
            return stream.text, stream.usage
        events += 1
        if stream.ended:
            break
        if leave_after_events is not None and events >= leave_after_events:
            r.outcome = "aborted"
            return stream.text, stream.usage
    if not stream.ended:
        r.outcome, r.error = "broken", "stream ended without its final event"
    elif stream.error is not None:
        r.outcome, r.error = "errored", stream.error
    elif stream.final_text != stream.text:
        r.outcome, r.error = "broken", "the final response's text is not the deltas'"
    else:
        r.outcome, r.finish = "completed", stream.finish
    return stream.text, stream.usage


def _read_within(
    resp: httpx.Response, start: float, leave_after_s: float | None, deadline_s: float
) -> bytes:
    chunks = []
    for chunk in resp.iter_bytes():
        chunks.append(chunk)
        if time.monotonic() - start > deadline_s:
            raise httpx.ReadTimeout("deadline")
    return b"".join(chunks)


def _json_text(raw: bytes, chat: bool) -> str:
    return choice_text(json.loads(raw)["choices"][0], chat)


def _classify_body(r: Result, status: int, raw: bytes, chat: bool, ids_out: list[int]) -> None:
    try:
        body = json.loads(raw)
    except ValueError:
        r.outcome, r.error = "broken", f"{status} body not JSON: {raw[:120]!r}"
        return
    if status != 200:
        err = body.get("error") if isinstance(body, dict) else None
        if isinstance(err, dict) and err.get("message"):
            r.outcome, r.error = (
                "errored",
                f"{status} {err.get('code')}: {str(err['message'])[:160]}",
            )
        else:
            r.outcome, r.error = "broken", f"{status} without an error body: {raw[:120]!r}"
        return
    try:
        (choice,) = body["choices"]
    except (KeyError, TypeError, ValueError):
        r.outcome, r.error = "broken", f"200 without one choice: {raw[:120]!r}"
        return
    ids_out.extend(choice.get("token_ids") or [])
    if choice.get("finish_reason") in ("length", "stop"):
        r.outcome, r.finish = "completed", choice["finish_reason"]
    else:
        r.outcome, r.error = "errored", f"200 finished with {choice.get('finish_reason')!r}"


def check_answer(r: Result, ref: tuple[list[int], str]) -> None:
    """Marks ``r`` wrong when its answer is not the reference's (or, for a partial answer,
    not the start of it)."""
    ids, text = r.ids, r.text
    ref_ids, ref_text = ref
    if r.responses:  # no token ids: the text
        ids, ref_ids = list(text.encode()), list(ref_text.encode())
    if r.outcome == "completed":
        if ids != ref_ids:
            r.wrong = True
            at = next(
                (i for i, (a, b) in enumerate(zip(ids, ref_ids, strict=False)) if a != b),
                min(len(ids), len(ref_ids)),
            )
            r.wrong_detail = (
                f"tokens differ at {at}: got {ids[at : at + 6]} want {ref_ids[at : at + 6]} "
                f"(got {len(ids)} tokens, want {len(ref_ids)})"
            )
        elif text != ref_text:
            r.wrong = True
            r.wrong_detail = f"text differs: got {text[:60]!r} want {ref_text[:60]!r}"
        elif r.ref_key[3] >= 0 and not STRUCTURED_CHECKS[r.ref_key[3]](text, r.finish == "stop"):
            # The reference broke the grammar too: both nodes' masks went wrong the same way.
            r.wrong = True
            r.wrong_detail = (
                f"answer (the reference's too) breaks its structured output "
                f"{STRUCTURED[r.ref_key[3]]} (finish {r.finish!r}): {text[:60]!r}"
            )
    elif ids and ids != ref_ids[: len(ids)]:
        # A partial answer (error event, client left) must still be the reference's start.
        r.wrong = True
        r.wrong_detail = (
            f"partial answer is not a prefix of the reference: {ids[:8]} vs {ref_ids[:8]}"
        )


# -- tenants (``--tenants``) ----------------------------------------------------------------

TokKey = tuple[int, bool]  # (prompt, chat): a prompt as the node tokenizes it


def compute_tokens(
    url: str, keys: set[TokKey], prompts: list[str], out: dict[TokKey, list[int]]
) -> None:
    """The prompt token ids (the reference node's ``/tokenize``, as a completion or chat
    renders them) of every (prompt, chat) in ``keys`` not in ``out`` yet."""
    for prompt, chat in sorted(set(keys) - set(out)):
        body: dict[str, Any] = {"model": MODEL}
        if chat:
            body["messages"] = [{"role": "user", "content": prompts[prompt]}]
            body["add_generation_prompt"] = True
        else:
            body["prompt"] = prompts[prompt]
        resp = httpx.post(url + "/tokenize", json=body, timeout=60)
        resp.raise_for_status()
        out[(prompt, chat)] = list(resp.json()["tokens"])


def _shared(a: list[int], b: list[int], block: int) -> int:
    """The tokens of the longest common prefix of ``a`` and ``b`` in whole blocks: the
    most of one a prefix cache holding the other's blocks can give."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n // block * block


def check_isolation(
    results: list[Result],
    tokens: dict[TokKey, list[int]],
    block: int,
    retried: Collection[str] = (),
) -> dict[str, Any]:
    """The tenants' prefix caches are apart: no answer's ``cached_tokens`` exceeds what
    its own tenant's requests could have left in a cache, whatever node served them
    (restarts only empty caches, D's own hits and P's are both within the tenant; every
    request of the tenant sent before this one ended counts, whatever its outcome, so
    concurrent ones and in-batch sharing are allowed for). A request the proxy ``retried``
    (by label) may hit what its own earlier attempt left (a prefill node it went to again,
    a decode node that recomputed the prompt when the KV did not come): its own prompt
    counts as sent before it, so only another prompt's hit is checked there. Marks each
    offending result's
    ``isolation``; returns the figures: answers checked, those with cached tokens, those
    ``exposed`` (another tenant had sent a longer shared prefix before: a cache shared
    across tenants would have shown there) and the violations."""
    keys = sorted({(r.ref_key[0], r.ref_key[1]) for r in results if r.tenant >= 0})
    shared = {(a, b): _shared(tokens[a], tokens[b], block) for a in keys for b in keys}
    # Per tenant and prompt: the requests' start times, earliest first.
    starts: dict[tuple[int, TokKey], list[tuple[float, int]]] = {}
    for r in results:
        if r.tenant >= 0:
            starts.setdefault((r.tenant, (r.ref_key[0], r.ref_key[1])), []).append(
                (r.t_start, id(r))
            )
    for v in starts.values():
        v.sort()

    def before(tenant: int, key: TokKey, r: Result) -> bool:
        """A request of ``tenant`` with ``key`` other than ``r`` sent before ``r`` ended."""
        return any(t < r.t_end and i != id(r) for t, i in starts.get((tenant, key), [])[:2])

    tenants = sorted({r.tenant for r in results if r.tenant >= 0})
    figures: dict[str, Any] = {
        "checked": 0, "hits": 0, "cached_tokens": 0, "exposed": 0, "retried": 0,
    }  # fmt: skip
    violations: list[str] = []
    for r in results:
        if r.tenant < 0 or r.cached is None:
            continue
        mine = (r.ref_key[0], r.ref_key[1])
        figures["checked"] += 1
        figures["hits"] += r.cached > 0
        figures["cached_tokens"] += r.cached
        if len(tokens[mine]) != r.prompt_tokens:  # the bound would be of another prompt
            r.isolation = (
                f"the check's tokenization of prompt {mine} has {len(tokens[mine])} tokens, "
                f"the answer's usage {r.prompt_tokens}"
            )
            violations.append(f"{r.label} #{r.index}: {r.isolation}")
            continue
        own = max((shared[mine, k] for k in keys if before(r.tenant, k, r)), default=0)
        if r.label in retried:  # its earlier attempts' blocks are its tenant's too
            own = max(own, shared[mine, mine])
            figures["retried"] += 1
        other = max(
            (shared[mine, k] for t in tenants if t != r.tenant for k in keys if before(t, k, r)),
            default=0,
        )
        figures["exposed"] += other > own
        if r.cached > own:
            r.isolation = (
                f"tenant {r.tenant}'s answer reports {r.cached} cached prompt tokens of "
                f"{r.prompt_tokens}; its own tenant's earlier requests share at most {own} "
                f"(another tenant's {other})"
            )
            violations.append(f"{r.label} #{r.index}: {r.isolation}")
    figures["violations"] = violations
    return figures
