"""The node's side of registration (``--register-with``): register with each proxy once
the node serves, renew the registration (a heartbeat), deregister on shutdown.

Runs one daemon thread per proxy with a blocking HTTP client, so it needs nothing from
the node's event loop and a proxy that does not answer delays only its own renewals. A
proxy that is down, or refuses, is retried every ``retry_s`` seconds; the outcome is logged
when it changes. Renewals come every ``interval`` seconds, and at least three times per
registration lifetime the proxy states (``expires_in``), but never more often than every
``MIN_RENEW_S`` (a proxy answering ``expires_in: 0.001`` made the node post every 0.3 ms),
so a registration never lapses while the node lives. ``stop()`` (from a signal handler:
``request_stop()``) ends the loops and posts the deregistrations (the proxy then stops
routing new requests here at once, while the node drains the ones it has).
"""

from __future__ import annotations

import logging
import threading
import time

import httpx

from proxy.registration import DEREGISTER_PATH, REGISTER_PATH

logger = logging.getLogger(__name__)

MIN_RENEW_S = 0.5


class Announcer:
    def __init__(
        self,
        proxies: list[str],
        role: str,
        url: str,
        key: str,
        interval: float = 10.0,
        retry_s: float = 2.0,
        timeout: float = 5.0,
    ) -> None:
        self.proxies = [p.rstrip("/") for p in proxies]
        self.body = {"role": role, "url": url}
        self.headers = {"Authorization": f"Bearer {key}"}
        self.interval = interval
        self.retry_s = min(retry_s, interval)
        self.timeout = timeout
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._ok: dict[str, bool | None] = dict.fromkeys(self.proxies)

    def start(self) -> None:
        if not self._threads:
            self._threads = [
                threading.Thread(target=self._run, args=(p,), name="pdserve-register", daemon=True)
                for p in self.proxies
            ]
            for t in self._threads:
                t.start()

    def request_stop(self) -> None:
        """Signal-safe: the thread deregisters and ends."""
        self._stop.set()

    def stop(self, timeout: float = 10.0) -> None:
        """Deregister from every proxy (at once: the threads post in parallel)."""
        self._stop.set()
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))

    def _run(self, proxy: str) -> None:
        with httpx.Client(timeout=self.timeout, headers=self.headers) as client:
            while not self._stop.is_set():
                self._stop.wait(max(MIN_RENEW_S, self._register(client, proxy)))
            self._post(client, proxy, DEREGISTER_PATH)

    def _register(self, client: httpx.Client, proxy: str) -> float:
        """Register once; seconds until the next try."""
        answer = self._post(client, proxy, REGISTER_PATH)
        if answer is None:
            return self.retry_s
        ttl = answer.get("expires_in")
        if isinstance(ttl, int | float) and ttl > 0:
            return min(self.interval, ttl / 3)
        return self.interval

    def _post(self, client: httpx.Client, proxy: str, path: str) -> dict[str, object] | None:
        what = "registration" if path == REGISTER_PATH else "deregistration"
        try:
            resp = client.post(proxy + path, json=self.body)
        except httpx.HTTPError as e:
            self._outcome(proxy, what, False, f"{type(e).__name__}: {e}")
            return None
        if resp.status_code != 200:
            self._outcome(proxy, what, False, f"HTTP {resp.status_code}: {resp.text[:300]}")
            return None
        self._outcome(proxy, what, True, "")
        try:
            answer = resp.json()
        except ValueError:
            return {}
        return answer if isinstance(answer, dict) else {}

    def _outcome(self, proxy: str, what: str, ok: bool, detail: str) -> None:
        if what == "deregistration":
            if ok:
                logger.info("deregistered from %s", proxy)
            else:
                logger.warning("deregistration from %s failed: %s", proxy, detail)
            return
        if self._ok[proxy] == ok:
            return
        self._ok[proxy] = ok
        if ok:
            logger.info(
                "registered as %s node %s with %s", self.body["role"], self.body["url"], proxy
            )
        else:
            logger.warning("registration with %s failed (retrying): %s", proxy, detail)
