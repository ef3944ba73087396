"""The penalties' state on the device (``engine/worker/penalties.py``): each request's
output counts and prompt ids are kept on the logits' device and updated in place, so a
step copies to the device only the tokens added since the last one (not the prompt's
ids, nor the whole output, every step), the state carries over from step to step, an
async placeholder counts in its step only, and a new table (preemption) starts over."""

from __future__ import annotations

import random
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from engine.core.scheduler_output import ScheduledSeq, SchedulerOutput
from engine.sampling_params import SamplingParams
from engine.worker.penalties import PenaltyHistory, PenaltyPool, apply_penalties
from engine.worker.request_states import RequestStates
from engine.worker.sampler import Sampler

PENALTIES = {"repetition_penalty": 1.6, "frequency_penalty": 0.7, "presence_penalty": 0.4}


class CountingCopy:
    """A ``to_device`` that records how many elements each step sent."""

    def __init__(self) -> None:
        self.sizes: list[int] = []

    def __call__(self, host: torch.Tensor, dev: torch.device) -> torch.Tensor:
        self.sizes.append(host.numel())
        return host.to(dev)


def reference(
    logits: torch.Tensor, sp: SamplingParams, prompt: list[int], output: list[int]
) -> torch.Tensor:
    """One row, written out (ids outside the vocabulary ignored)."""
    vocab = logits.shape[0]
    x = logits.clone()
    for t in {t for t in prompt + output if 0 <= t < vocab}:
        x[t] = x[t] / sp.repetition_penalty if x[t] > 0 else x[t] * sp.repetition_penalty
    counts = Counter(t for t in output if 0 <= t < vocab)
    for t, c in counts.items():
        x[t] -= sp.frequency_penalty * c + sp.presence_penalty
    return x


def test_after_the_first_step_a_step_copies_only_its_new_tokens_not_the_prompt():
    vocab, rows, prompt_len = 5000, 4, 20_000
    rng = random.Random(0)
    sp = SamplingParams(temperature=0, **PENALTIES)
    # Long prompts (two ids an offline caller might send: outside the vocabulary).
    prompts = [[rng.randrange(vocab) for _ in range(prompt_len)] + [-3, vocab + 5]] * rows
    outputs: list[list[int]] = [[] for _ in range(rows)]
    histories = [PenaltyHistory(len(p)) for p in prompts]
    for h, p in zip(histories, prompts, strict=True):
        h.add(p)
    copy, pool = CountingCopy(), PenaltyPool()
    gen = torch.Generator().manual_seed(1)
    for step in range(6):
        logits = torch.randn(rows, vocab, generator=gen) * 3
        got = apply_penalties(logits, [sp] * rows, list(histories), None, copy, pool)
        for i in range(rows):
            assert torch.equal(got[i], reference(logits[i], sp, prompts[i], outputs[i])), step
        for i, h in enumerate(histories):  # the step's samples reach the histories
            token = rng.randrange(vocab)
            outputs[i].append(token)
            h.add([token])
    factors = 3 * rows
    assert copy.sizes[0] >= rows * len(set(prompts[0])) - 2  # the first step: the prompts
    # Every later step: the factors, the rows' slots and one new token per row, whatever
    # the prompt's length.
    assert copy.sizes[1:] == [factors + rows + rows] * 5, copy.sizes


def test_the_state_carries_over_steps_counts_a_placeholder_once_and_a_new_table_starts_over():
    vocab = 64
    sp = SamplingParams(temperature=0, **PENALTIES)
    worker, pool = RequestStates(), PenaltyPool()
    prompt = [5, 6, 6, 70]  # 70: outside the vocabulary
    gen = torch.Generator().manual_seed(2)

    def step(seq: ScheduledSeq, pending: int | None, output: list[int]) -> PenaltyHistory:
        worker.update(SchedulerOutput(0, [seq]))
        h = worker.penalty("r")
        assert h is not None
        logits = torch.randn(1, vocab, generator=gen) * 3
        # Async scheduling: the previous step's sample, not in the history yet.
        placeholder = ([0], [0], torch.tensor([pending])) if pending is not None else None
        got = apply_penalties(logits, [sp], [h], placeholder, CountingCopy(), pool)
        seen_output = output + ([pending] if pending is not None else [])
        assert torch.equal(got[0], reference(logits[0], sp, prompt, seen_output))
        return h

    def first(tokens: list[int]) -> ScheduledSeq:
        return ScheduledSeq("r", tokens[:1], 0, [1, 2], sp, penalty_token_ids=tokens,
                            num_prompt_tokens=len(prompt))  # fmt: skip

    def then(tokens: list[int], blocks: int = 2) -> ScheduledSeq:
        return ScheduledSeq("r", [1], 4, [], penalty_token_ids=tokens, num_blocks=blocks,
                            num_prompt_tokens=len(prompt), new_table=False)  # fmt: skip

    h = step(first(prompt), None, [])
    assert h.counts is not None and h.in_prompt is not None
    assert h.in_prompt.nonzero().flatten().tolist() == [5, 6] and not h.counts.any()
    h = step(then([9]), pending=None, output=[9])
    assert h.counts.nonzero().flatten().tolist() == [9]
    # Async: 9's successor 9 is a placeholder this step (counted here, not kept) ...
    h2 = step(then([]), pending=9, output=[9])
    assert h2 is h and h.counts[9].item() == 1.0
    # ... and the scheduler sends it afterwards: counted once, with the next placeholder.
    step(then([9]), pending=6, output=[9, 9])
    assert h.counts[9].item() == 2.0 and h.counts[6].item() == 0.0
    assert h.output == {9: 2} and h.prompt == {5, 6}
    # Preempted, then computed again: a new table and every token again, once.
    fresh = step(first([*prompt, 9, 9, 6]), None, [9, 9, 6])
    assert fresh is not h and fresh.slot != h.slot
    assert fresh.output == {9: 2, 6: 1} and fresh.prompt == {5, 6}


class DeviceOps(TorchDispatchMode):
    """Counts the aten ops that would launch work on a device (views excluded: they
    only make a new tensor header)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if not func.is_view:
            self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def _decode_step_ops(rows: int) -> int:
    """The device ops of one decode step (one new token per row) of ``rows`` penalized
    rows, after a first step that sent the prompts."""
    vocab = 300
    sp = SamplingParams(temperature=0, **PENALTIES)
    histories = [PenaltyHistory(3) for _ in range(rows)]
    for i, h in enumerate(histories):
        h.add([i, i + 1, i + 2])
    gen = torch.Generator().manual_seed(3)
    sampler = Sampler()
    sampler.sample(torch.randn(rows, vocab, generator=gen), [sp] * rows, [3] * rows,
                   penalties=list(histories))  # fmt: skip
    for i, h in enumerate(histories):
        h.add([7 * i % vocab])
    logits = torch.randn(rows, vocab, generator=gen)
    with DeviceOps() as ops:
        sampler.sample(logits, [sp] * rows, [4] * rows, penalties=list(histories))
    return sum(ops.ops.values())


def test_a_decode_steps_penalty_work_is_a_fixed_number_of_kernels_whatever_the_batch():
    # On a GPU each op is a launch (host time the device waits for): a step's penalties
    # must not cost one per row.
    assert _decode_step_ops(32) == _decode_step_ops(2)


def test_a_finished_requests_slot_is_given_back_and_its_next_owner_starts_from_zero():
    vocab = 50
    sp = SamplingParams(temperature=0, **PENALTIES)
    pool = PenaltyPool()
    gen = torch.Generator().manual_seed(4)

    def step(histories: list[PenaltyHistory]) -> torch.Tensor:
        logits = torch.randn(len(histories), vocab, generator=gen) * 3
        n = len(histories)
        return logits, apply_penalties(
            logits, [sp] * n, list(histories), None, CountingCopy(), pool
        )

    old = [PenaltyHistory(2) for _ in range(3)]
    for h in old:
        h.add([1, 2, 3, 3, 3])  # prompt 1, 2; output 3 three times
    step(old)
    slots = {h.slot for h in old}
    assert len(slots) == 3 and 0 not in slots  # slot 0: the zeros of unpenalized rows
    del h, old  # the requests finished: their histories dropped
    new = PenaltyHistory(1)
    new.add([9, 4])
    logits, got = step([new])
    assert new.slot in slots and pool.capacity == 4  # a slot reused, the pool not grown
    assert torch.equal(got[0], reference(logits[0], sp, [9], [4]))  # nothing of the old owner


def test_a_pool_sized_for_max_num_seqs_is_made_whole_at_first_use_and_does_not_grow():
    # The memory profile sizes the KV cache with this pool in it: no later growth (and no
    # transient copy of it) may take memory the cache was given.
    pool = PenaltyPool(max_slots=4)
    sp = SamplingParams(temperature=0, **PENALTIES)
    histories = [PenaltyHistory(1) for _ in range(4)]
    for h in histories:
        h.add([1, 2])
    apply_penalties(torch.zeros(1, 10), [sp], histories[:1], None, CountingCopy(), pool)
    assert pool.capacity == 5  # slot 0 (zeros) and one per request
    apply_penalties(torch.zeros(4, 10), [sp] * 4, histories, None, CountingCopy(), pool)
    assert pool.capacity == 5 and sorted(h.slot for h in histories) == [1, 2, 3, 4]
