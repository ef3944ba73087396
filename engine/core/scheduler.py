"""Continuous-batching scheduler with one token-accounting model.

Every request's ``num_computed_tokens`` catches up with its ``num_tokens``: a step gives
each running request ``num_tokens - num_computed_tokens`` tokens (capped by the step's
token budget, which makes long prompts chunked), and samples the next token when the
step reaches the last known token. ``num_computed_tokens`` advances when a step is
scheduled (as vLLM v1), so it counts the tokens whose KV is in the cache or is being
written by a step already sent. Remote KV (from a prefill node) advances it without a
forward pass. When blocks run out, the most recently admitted running request is
preempted and later recomputed from scratch (its prefix cache entries usually make that
cheap).

With async scheduling (the default; ``--no-async-scheduling``: off) the engine schedules
step N+1 while step N runs: a token step N samples is not known yet, so it counts as a
placeholder (``Request.num_output_placeholders``) -- step N+1 computes it (the workers
fill in what they sampled in step N) and ``update_from_output`` of step N turns it into a
real token.
A request whose pending sample surely ends it (``max_tokens``, the context) is not
scheduled ahead, nor preempted; one that stops on EOS or a stop id has computed one token
too many, which is dropped. A step's results apply only to the requests it scheduled:
not to one finished, preempted or replaced since. The blocks of a request that ends or is
preempted while a step not yet updated scheduled it are freed at that step's update (its
forward may still write them; a remote load given one must not take a late local write):
``steps_in_flight.py`` keeps those steps.

What a new output token means to its request (an ending, or an output) is
``output_tokens.py``'s; the checks of a new request against this node are
``request_checks.py``'s.

Requests arriving together with the same prompt prefix (``n`` > 1 choices, one system
prompt) compute it once: a request whose next ``MIN_SHARED_PREFIX_TOKENS`` or more prompt
tokens (full blocks) a step not finished yet computes for another request waits -- the
requests behind it pass -- until that step is done, and then starts from the prefix cache
(SGLang's in-batch prefix caching; vLLM computes such prompts once per request).

What a step's sampling rows are constrained to beyond their parameters -- structured
outputs' grammar masks, ``bad_words``' bans, made after the token in flight when they
follow it -- is ``constraints.py``'s (``SamplingConstraints``); a request it finds stuck
is ended here, as every request is.
"""

from __future__ import annotations

import bisect
import dataclasses
import enum
import logging
import time
from collections import deque
from typing import TYPE_CHECKING

from engine.config import EngineConfig
from engine.core.constraints import SamplingConstraints, Stuck
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.output_tokens import checked_first_token, request_output, token_ending
from engine.core.request import Request, RequestStatus
from engine.core.request_checks import check_request
from engine.core.scheduler_output import (
    PLACEHOLDER_TOKEN_ID,
    DeferredSampling,
    ModelRunnerOutput,
    ScheduledSeq,
    SchedulerOutput,
)
from engine.core.scheduler_stats import RequestMetrics, SchedulerStats
from engine.core.steps_in_flight import StepsInFlight
from engine.outputs import RequestOutput, TokenLogprob
from engine.sampling_params import InvalidRequestError
from engine.structured.matcher import GrammarState
from kvconnector.base import KV_NOT_RESERVED, KVConnectorScheduler

if TYPE_CHECKING:
    from engine.structured.compiler import GrammarCompiler
    from kvconnector.params import KVTransferParams

logger = logging.getLogger(__name__)

# A waiting request whose next this-many prompt tokens (or more) a step not finished yet
# computes for another request waits for that step (SGLang's threshold for the same).
MIN_SHARED_PREFIX_TOKENS = 32


def _order(req: Request) -> tuple[int, float]:
    """--scheduling-policy priority: who goes first (the smaller)."""
    return req.priority, req.arrival_time


class _Start(enum.Enum):
    STARTED = enum.auto()  # running, or reserved for a remote load
    NO_ROOM = enum.auto()  # no blocks this step
    WAITS_FOR_PREFIX = enum.auto()  # another request computes its prefix in a step in flight


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        num_blocks: int,
        max_model_len: int,
        connector: KVConnectorScheduler,
        grammars: GrammarCompiler | None = None,
        vocab_size: int | None = None,
    ) -> None:
        self.config = config
        self.vocab_size = vocab_size  # bounds a prefill peer's first token
        self.max_model_len = max_model_len
        self.max_num_seqs = config.scheduler.max_num_seqs
        self.max_num_batched_tokens = config.scheduler.max_num_batched_tokens
        self.async_scheduling = config.scheduler.async_scheduling
        self.by_priority = config.scheduler.scheduling_policy == "priority"
        self.block_size = config.cache.block_size
        self.kv = KVCacheManager(num_blocks, self.block_size, config.cache.enable_prefix_caching)
        self.connector = connector
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.remote_waiting: dict[str, Request] = {}  # WAITING_FOR_REMOTE_KV
        self.held: dict[str, Request] = {}  # finished; blocks held by the connector
        # Blocks of failed remote loads that a late WRITE may still touch.
        self.quarantine: dict[str, list[int]] = {}
        self._finished_ids: set[str] = set()
        self._preempted_ids: set[str] = set()
        # Per step not yet updated: the requests it scheduled (its results go to these
        # objects only: a request finished, preempted or replaced since is skipped), and
        # the blocks freed at its update.
        self.in_flight = StepsInFlight(self.kv)
        self._outputs: list[RequestOutput] = []
        self._step = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.num_preemptions_total = 0
        self.request_metrics = RequestMetrics(max_model_len)
        # Structured outputs: the compiler of their grammars (a request's matcher, at
        # admission); the sampling rows' grammar masks and bad words' bans.
        self.grammars = grammars
        self.constraints = SamplingConstraints(grammars)

    # -- admission -----------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Admit a request. The one place that checks a request against this node -- its id
        not in use, its prompt neither empty, outside the vocabulary nor too long for the
        context, its blocks -- whoever submits it (HTTP layer or offline caller); the HTTP
        layer checks the request's shape. Raises ``InvalidRequestError``."""
        check_request(
            request,
            self.requests,
            self.quarantine,
            by_priority=self.by_priority,
            vocab_size=self.vocab_size,
            max_model_len=self.max_model_len,
        )
        rid, n = request.request_id, request.num_prompt_tokens
        so = request.sampling_params.structured_output
        if so is not None and request.grammar is None:  # offline; HTTP requests come with it
            if self.grammars is None:
                raise InvalidRequestError("this engine has no structured outputs", so.param)
            matcher = self.grammars.new_matcher(so)
            sp = request.sampling_params
            request.grammar = GrammarState(matcher, sp.reasoning_tags, sp.allowed_token_ids)
        if request.sampling_params.max_tokens is None:  # vLLM's: up to the context
            request.sampling_params = dataclasses.replace(
                request.sampling_params, max_tokens=max(1, self.max_model_len - n)
            )
        self.connector.prepare_request(request)  # P/D policy: may set max_tokens and seed
        total = min(n + request.sampling_params.max_tokens, self.max_model_len)
        if self.kv.blocks_needed(total) > self.kv.num_blocks:
            raise InvalidRequestError(
                f"the request needs {self.kv.blocks_needed(total)} KV blocks but this node "
                f"has {self.kv.num_blocks}; lower max_tokens or the prompt length",
                "max_tokens",
            )
        self.requests[rid] = request
        if self.by_priority:
            bisect.insort(self.waiting, request, key=_order)
        else:
            self.waiting.append(request)

    def abort_request(
        self, request_id: str, error: str | None = None, reason: str = "abort"
    ) -> None:
        """End a request before its end: with ``error``, an error; else aborted, counted in
        ``request_success`` under ``reason``: "abort" (a client gone), or "stop" when the
        caller ended it at a stop string (vLLM's output processor finishes such a request
        with STOP and aborts it in its engine core). Either way its blocks are freed as
        an abort's. One that had ended by itself, its finish not yet counted, counts as
        the engine ended it -- or "stop" (``RequestMetrics.settle``)."""
        self.request_metrics.settle(request_id, stop_string=reason == "stop")
        req = self.requests.get(request_id)
        if req is None:
            return
        if req.status.finished:
            if request_id in self.held:
                self.connector.abort_held(req)
            return
        status = RequestStatus.FINISHED_ERROR if error else RequestStatus.FINISHED_ABORTED
        self._finish(req, status, error, counted_as=None if error else reason)

    def settle(self, request_id: str, stop_string: bool) -> None:
        """The caller has the whole answer of ``request_id``, which ended by itself: at a
        stop string (counted as "stop"), or not (``RequestMetrics.settle``)."""
        self.request_metrics.settle(request_id, stop_string)

    def has_work(self) -> bool:
        return bool(
            self.waiting
            or self.running
            or self.remote_waiting
            or self.held
            or self.quarantine
            or self._outputs
            or self.connector.has_pending_work()
        )

    # -- one step ------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        self._step += 1
        self._apply_connector_events()
        budget = self.max_num_batched_tokens
        seqs: list[ScheduledSeq] = []

        scheduled: dict[str, tuple[Request, int]] = {}
        self.constraints.begin_step()
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if req.num_output_placeholders and self._ends_with_pending(req):
                # Its sample in flight ends it: nothing to compute ahead. (A next sample
                # whose grammar mask or bad words' ban needs that token is scheduled: they
                # are made after its update, ``deferred_sampling``.)
                i += 1
                continue
            n = min(req.num_tokens + req.num_output_placeholders - req.num_computed_tokens, budget)
            blocks = self.kv.allocate_slots(req, n)
            while blocks is None:
                if self._blocks_coming_back():
                    break  # async scheduling: wait a step for them rather than preempt
                # The last: never one this step already scheduled (the loop goes in
                # order), whose blocks would go to another request while the step writes
                # them; by priority, ``running`` is kept in (priority, arrival) order.
                victim = self.running.pop()
                freed_now = self._preempt(victim)
                preempted = True
                if victim is req or not freed_now:
                    break  # (a victim in the step in flight gives its blocks back at its update)
                blocks = self.kv.allocate_slots(req, n)
            if blocks is None:
                break
            seqs.append(self._scheduled(req, n))
            scheduled[req.request_id] = (req, req.num_preemptions)
            budget -= n
            i += 1

        # Waiting on a peer or on a prefix another request computes: those behind pass.
        # None starts in a step that preempted (as vLLM): the room is the running
        # requests' -- under async scheduling a victim's blocks come back only at the
        # update, and the victim, admitted again from what is free (its prompt cached),
        # was preempted again every step while the request that needed room waited.
        delayed: list[Request] = []
        while (
            self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not preempted
        ):
            req = self.waiting[0]
            if req.status == RequestStatus.WAITING and self.connector.delay_admission(req):
                delayed.append(self.waiting.popleft())
                continue
            start = self._admit(req, budget, seqs)
            if start is _Start.NO_ROOM:
                break
            self.waiting.popleft()
            if start is _Start.WAITS_FOR_PREFIX:
                delayed.append(req)
                continue
            if req.status == RequestStatus.RUNNING:
                budget -= seqs[-1].num_tokens
                scheduled[req.request_id] = (req, req.num_preemptions)
        self.waiting.extendleft(reversed(delayed))  # in their places, first in line

        out = SchedulerOutput(
            step_id=self._step,
            seqs=seqs,
            finished_request_ids=self._finished_ids,
            preempted_request_ids=self._preempted_ids,
        )
        self.in_flight.sent(self._step, scheduled)
        self._finished_ids, self._preempted_ids = set(), set()
        self._end_stuck(self.constraints.end_step(out))  # masks, or sampling_deferred
        out.kv_connector_metadata = self.connector.build_connector_meta(out, self.kv.block_ids)
        return out

    def deferred_sampling(self, sched: SchedulerOutput) -> DeferredSampling:
        """Async scheduling: the masks and bans of a step sent with ``sampling_deferred``,
        once the step before it was updated (the tokens its rows follow are known now);
        the engine sends them to the workers, which sample with them. Requests that ended
        since get none (they sample in vain); those that cannot go on end here."""
        deferred, stuck = self.constraints.deferred(sched.step_id)
        self._end_stuck(stuck)
        return deferred

    def _end_stuck(self, stuck: list[Stuck]) -> None:
        """End (with why) each request whose grammar allows no next token it may take
        (``SamplingConstraints``); its row of this step samples in vain."""
        for req, why in stuck:
            logger.info("request %s: %s", req.request_id, why)
            self._finish(req, RequestStatus.FINISHED_ERROR, why, "structured_output_stuck")

    def _blocks_coming_back(self) -> bool:
        """Async scheduling: blocks return at the update of the step in flight -- of
        requests that ended or were preempted since it was sent, or that its samples end
        (a sync step would have finished those before scheduling). Never in sync mode."""
        return self.in_flight.blocks_waiting() or any(
            r.num_output_placeholders and self._ends_with_pending(r) for r in self.running
        )

    def _free_blocks(self, request_id: str) -> bool:
        """Free the request's blocks now (True), or -- when a step not updated yet scheduled
        it (async scheduling) -- at that step's update: its forward may still write them,
        and a block handed to a remote load must not take a late local write after the
        remote one."""
        return self.in_flight.free_blocks(request_id)

    def forget_steps_in_flight(self) -> None:
        """The workers are gone (the executor died): no step in flight will be updated or
        write anything, so the blocks waiting for those updates are free now."""
        self.in_flight.forget()
        self.constraints.forget_steps_in_flight()
        self.kv.forget_steps_in_flight()

    def _ends_with_pending(self, req: Request) -> bool:
        """The sample(s) in flight end ``req`` whatever they are (length or context)."""
        n = req.num_output_placeholders
        return (
            req.num_output_tokens + n >= req.sampling_params.max_tokens
            or req.num_tokens + n >= self.max_model_len
        )

    def _admit(self, req: Request, budget: int, seqs: list[ScheduledSeq]) -> _Start:
        """Try to start ``req``."""
        # Prompt logprobs need the prompt computed here: no prefix-cache hits (as vLLM).
        computed = [] if req.needs_prompt_logprobs else self.kv.get_computed_blocks(req)
        num_cached = len(computed) * self.block_size
        ext, load_async = 0, False
        if req.status == RequestStatus.WAITING:  # not for preempted requests
            ext, load_async = self.connector.get_num_new_matched_tokens(req, num_cached)
        req.num_cached_prompt_tokens = min(num_cached, req.num_prompt_tokens)
        req.num_external_prompt_tokens = ext if load_async else 0
        if load_async:
            # Reserve blocks for the remote KV; the request waits until it has landed.
            req.num_computed_tokens = num_cached
            blocks = self.kv.allocate_slots(req, ext, computed)
            if blocks is None:
                req.num_computed_tokens = 0
                return _Start.NO_ROOM
            req.status = RequestStatus.WAITING_FOR_REMOTE_KV
            self._first_admission(req)
            self.remote_waiting[req.request_id] = req
            self.connector.update_state_after_alloc(req, blocks, ext)
            return _Start.STARTED
        if not req.needs_prompt_logprobs:
            shared = self.kv.num_blocks_in_flight(req, len(computed)) * self.block_size
            if shared >= MIN_SHARED_PREFIX_TOKENS:
                logger.debug(
                    "%s waits a step for %d prompt tokens in flight", req.request_id, shared
                )
                return _Start.WAITS_FOR_PREFIX
        req.num_computed_tokens = num_cached
        n = min(req.num_tokens - num_cached, budget)
        blocks = self.kv.allocate_slots(req, n, computed)
        if blocks is None:
            req.num_computed_tokens = 0
            return _Start.NO_ROOM
        req.status = RequestStatus.RUNNING
        self._first_admission(req)
        self._add_running(req)
        seqs.append(self._scheduled(req, n))
        return _Start.STARTED

    @staticmethod
    def _first_admission(req: Request) -> None:
        """``req`` started: its first start is its scheduled time and fixes how many
        prompt tokens the prefix cache gave it (vLLM's ``num_cached_tokens``)."""
        RequestMetrics.scheduled(req, time.monotonic())
        if req.num_cached_tokens is None:
            req.num_cached_tokens = req.num_cached_prompt_tokens

    def _scheduled(self, req: Request, n: int) -> ScheduledSeq:
        """``req``'s slice of this step: ``n`` tokens from ``num_computed_tokens`` on, which
        advances by ``n`` (the step is sent)."""
        start = req.num_computed_tokens
        end = start + n
        samples = end == req.num_tokens + req.num_output_placeholders
        sp = req.sampling_params
        new_blocks, new_table, num_blocks = self.kv.blocks_to_send(req.request_id)
        self.kv.computing(self._step, req, start, end)
        token_ids = req.all_token_ids[start:end]
        if len(token_ids) < n:  # the last one is sampled by the step in flight
            assert len(token_ids) == n - 1, (req, start, n)
            token_ids.append(PLACEHOLDER_TOKEN_ID)
        seq = ScheduledSeq(
            request_id=req.request_id,
            token_ids=token_ids,
            start_pos=start,
            new_block_ids=new_blocks,
            sampling_params=sp if new_table else None,  # the workers keep it with the table
            num_blocks=num_blocks,
            new_table=new_table,
            samples=samples,
        )
        if sp.has_penalties:
            if new_table:
                req.penalty_tokens_sent = 0
            seq.penalty_token_ids = req.all_token_ids[req.penalty_tokens_sent :]
            seq.num_prompt_tokens = req.num_prompt_tokens
            req.penalty_tokens_sent = req.num_tokens
        # Outputs before this sample (placeholders included) below min_tokens: mask.
        if samples and end - req.num_prompt_tokens < sp.min_tokens:
            seq.banned_token_ids = req.banned_token_ids
        if req.needs_prompt_logprobs:
            # Row p predicts the token at p + 1; the prompt tokens not computed yet (the
            # first has none) are predicted by rows len(prompt_logprobs) - 1 ...
            lps = req.prompt_logprobs
            assert lps is not None
            first = max(start, len(lps) - 1)
            last = min(end, req.num_prompt_tokens - 1)
            if last > first:
                seq.prompt_row = first - start
                seq.prompt_targets = req.prompt_token_ids[first + 1 : last + 1]
                seq.prompt_logprobs = sp.prompt_logprobs or 0
        req.num_computed_tokens = end
        if samples:
            self.constraints.add_row(req, seq)  # its grammar mask, bad words' ban
            if self.async_scheduling:
                req.num_output_placeholders += 1
        return seq

    def _add_running(self, req: Request) -> None:
        """Into ``running``: last (admission order), or by priority in its place."""
        if self.by_priority:
            bisect.insort(self.running, req, key=_order)
        else:
            self.running.append(req)

    def _requeue(self, req: Request) -> None:
        """Back into the waiting queue, first in line (by priority: in its place)."""
        if self.by_priority:
            bisect.insort(self.waiting, req, key=_order)
        else:
            self.waiting.appendleft(req)

    def _preempt(self, req: Request) -> bool:
        """Preempt ``req``; True when its blocks are free now (not at a later update)."""
        logger.info("preempting %s (recompute later)", req.request_id)
        freed_now = self._free_blocks(req.request_id)
        req.num_computed_tokens = 0
        req.num_output_placeholders = 0  # a step in flight samples for it in vain
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions_total += 1
        self._preempted_ids.add(req.request_id)
        self._requeue(req)
        return freed_now

    def update_from_output(
        self, sched_out: SchedulerOutput, output: ModelRunnerOutput
    ) -> list[RequestOutput]:
        self.kv.step_done(sched_out.step_id)  # its blocks are cached below, or never
        scheduled = self.in_flight.updated(sched_out.step_id)  # and its late frees done
        for seq in sched_out.seqs:
            req, preemptions = scheduled.get(seq.request_id, (None, 0))
            if req is None or req.status != RequestStatus.RUNNING:
                continue  # finished (aborted) while the step ran
            if req.num_preemptions != preemptions:
                continue  # preempted (and admitted again) since: not its tokens now
            if seq.start_pos + seq.num_tokens <= req.num_prompt_tokens:
                self.prompt_tokens_total += seq.num_tokens
            self.kv.cache_computed_blocks(req)
            if seq.prompt_targets and req.prompt_logprobs is not None:
                req.prompt_logprobs.extend(output.prompt_logprobs.get(req.request_id, ()))
            if seq.samples:
                rid = req.request_id
                if req.num_output_placeholders:
                    req.num_output_placeholders -= 1
                self._append(req, output.sampled_token_ids[rid], output.logprobs.get(rid))

        # The connector learns first what landed and what was sent, so that a request
        # finishing right below is not mistaken for one aborted while still waiting.
        landed = self.connector.update_connector_output(output)
        for rid, info in landed.items():
            req = self.remote_waiting.pop(rid, None)
            if req is None:
                continue
            self._remote_kv_landed(req, info)

        for rid in output.finished_sending:
            self._release_held(rid)
        return self.take_outputs()

    def take_outputs(self) -> list[RequestOutput]:
        outputs, self._outputs = self._outputs, []
        return outputs

    def _remote_kv_landed(self, req: Request, info: dict) -> None:
        """The prompt's KV arrived: continue from the first token the prefill node sampled."""
        req.num_computed_tokens = req.num_prompt_tokens
        self.kv.cache_computed_blocks(req)
        req.status = RequestStatus.RUNNING
        self._add_running(req)
        if req.prompt_logprobs is not None:  # computed by the prefill node, not here
            req.prompt_logprobs.extend([None] * (req.num_prompt_tokens - len(req.prompt_logprobs)))
        first = checked_first_token(req, info, self.vocab_size)
        if first is None:  # no token came with the KV: compute the last prompt token again
            req.num_computed_tokens -= 1
            return
        self._append(req, first)

    def _append(self, req: Request, token: int, logprob: TokenLogprob | None = None) -> None:
        req.append_token(token, logprob)
        self.generation_tokens_total += 1
        self.request_metrics.token(req, time.monotonic())
        ending = token_ending(req, token, self.max_model_len)
        if ending is not None:
            self._finish(req, *ending)
        else:
            self._emit(req)

    # -- endings -------------------------------------------------------------------------
    def _finish(
        self,
        req: Request,
        status: RequestStatus,
        error: str | None = None,
        error_code: str | None = None,
        counted_as: str | None = None,
    ) -> None:
        """``counted_as``: the finish reason for the request metrics, when not the
        status's (an abort at a stop string counts as "stop")."""
        rid = req.request_id
        prev = req.status
        req.status = status
        req.error, req.error_code = error, error_code
        if prev == RequestStatus.RUNNING:
            self.running.remove(req)
        elif prev in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            self.waiting.remove(req)
        elif prev == RequestStatus.WAITING_FOR_REMOTE_KV:
            del self.remote_waiting[rid]
        if counted_as is not None:
            self.request_metrics.count(req, counted_as, time.monotonic())
        else:
            self.request_metrics.finished(req, status.finish_reason, time.monotonic())
        delay_free, params = self.connector.request_finished(req, self.kv.block_ids(rid))
        self._finished_ids.add(rid)
        if delay_free:
            self.held[rid] = req
        else:
            self._free_blocks(rid)
            del self.requests[rid]
        self._emit(req, params)

    def _release_held(self, rid: str) -> None:
        req = self.held.pop(rid, None)
        if req is not None:
            self._free_blocks(rid)
            self.requests.pop(rid, None)

    def _emit(self, req: Request, kv_transfer_params: KVTransferParams | None = None) -> None:
        self._outputs.append(request_output(req, kv_transfer_params))

    def _apply_connector_events(self) -> None:
        events = self.connector.take_events()
        for rid, reason in events.failed_waiting.items():
            req = self.requests.get(rid)
            if req is None or req.status != RequestStatus.WAITING:
                continue
            if reason is None:  # its peer cancelled it
                self._finish(req, RequestStatus.FINISHED_ABORTED)
            else:
                logger.warning("request %s: %s", rid, reason)
                self._finish(req, RequestStatus.FINISHED_ERROR, reason, KV_NOT_RESERVED)
        for rid, reason in events.failed_loads.items():
            req = self.remote_waiting.pop(rid, None)
            if req is None:
                continue
            # A WRITE into the reserved blocks may still land: park them until the
            # connector says they are safe (a later free_blocks event), and go on with
            # fresh blocks -- or fail the request, by the failure policy.
            self.quarantine.setdefault(rid, []).extend(self.kv.detach(rid))
            if self.config.kv_transfer.kv_failure_policy == "fail":
                req.status = RequestStatus.FINISHED_ERROR
                req.error = f"KV transfer failed: {reason}"
                self._finished_ids.add(rid)
                del self.requests[rid]
                self._emit(req)
            else:
                logger.warning("request %s: remote KV failed (%s); recomputing", rid, reason)
                req.num_computed_tokens = 0
                req.status = RequestStatus.PREEMPTED
                self._requeue(req)
        for rid in events.free_blocks:
            self._release_held(rid)
            blocks = self.quarantine.pop(rid, None)
            if blocks:
                self.kv.pool.free(blocks)

    # -- introspection -------------------------------------------------------------------
    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=len(self.running),
            # As vLLM counts them: a request waiting for its KV is in its waiting queue.
            num_waiting=len(self.waiting) + len(self.remote_waiting),
            num_waiting_for_remote_kv=len(self.remote_waiting),
            num_held=len(self.held),
            num_quarantined_blocks=sum(len(b) for b in self.quarantine.values()),
            kv_blocks_total=self.kv.num_blocks,
            kv_blocks_free=self.kv.pool.num_free,
            kv_blocks_used=self.kv.pool.num_used,
            prompt_tokens_total=self.prompt_tokens_total,
            generation_tokens_total=self.generation_tokens_total,
            num_preemptions_total=self.num_preemptions_total,
            **self.request_metrics.stats(),  # type: ignore[arg-type]
        )
