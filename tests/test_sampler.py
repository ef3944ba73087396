"""The batched sampler: greedy rows, the (seed, position) rule, filters, and the law it draws."""

from __future__ import annotations

import math

import pytest
import torch

from engine.sampling_params import SamplingParams
from engine.worker.sampler import Sampler, hashed_uniform, position_seed

VOCAB = 50


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_rows_take_the_argmax_in_a_mixed_batch():
    logits = _logits(4)
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.0, seed=3),
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.7, top_k=5),
    ]
    out = Sampler().sample(logits, params, [10, 11, 12, 13])
    assert out[0] == int(logits[0].argmax()) and out[2] == int(logits[2].argmax())


def test_seeded_row_depends_on_seed_and_position_only():
    logits = (_logits(1) / 6).expand(64, VOCAB)
    sp = SamplingParams(temperature=1.0, seed=42)
    a = Sampler().sample(logits, [sp] * 64, list(range(64)))
    b = Sampler().sample(logits, [sp] * 64, list(range(64)))  # another sampler (another node)
    assert a == b
    assert len(set(a)) > 5  # positions draw different tokens
    # Same position in another batch slot and batch size gives the same token.
    again = Sampler().sample(logits[:1].clone(), [sp], [7])
    assert again == [a[7]]


def test_unseeded_rows_differ_between_draws():
    logits = torch.zeros(200, VOCAB)  # uniform
    sp = SamplingParams(temperature=1.0)
    sampler = Sampler()
    assert sampler.sample(logits, [sp] * 200, [0] * 200) != sampler.sample(
        logits, [sp] * 200, [0] * 200
    )


def test_draws_follow_the_softmax_law():
    # 20,000 seeded draws from one distribution: frequencies within 5 sigma of p.
    torch.manual_seed(0)
    row = torch.randn(VOCAB) * 1.5
    n = 20_000
    params = [SamplingParams(temperature=0.8, seed=s) for s in range(n)]
    tokens = Sampler().sample(row.expand(n, VOCAB), params, [5] * n)
    counts = torch.bincount(torch.tensor(tokens), minlength=VOCAB).double()
    p = torch.softmax(row.double() / 0.8, dim=-1)
    sigma = torch.sqrt(n * p * (1 - p))
    assert torch.all((counts - n * p).abs() <= 5 * sigma + 1), (counts, n * p)


@pytest.mark.parametrize("top_k,top_p", [(3, 1.0), (-1, 0.5), (10, 0.3)])
def test_filters_never_draw_outside_the_kept_set(top_k, top_p):
    torch.manual_seed(1)
    row = torch.randn(VOCAB) * 2
    n = 2000
    params = [SamplingParams(temperature=1.0, top_k=top_k, top_p=top_p, seed=s) for s in range(n)]
    tokens = set(Sampler().sample(row.expand(n, VOCAB), params, [0] * n))
    order = torch.argsort(row, descending=True).tolist()
    kept = order[:top_k] if top_k > 0 else order
    probs = torch.softmax(row[kept], dim=-1)
    cum = torch.cumsum(probs, dim=-1) - probs
    kept = [t for t, c in zip(kept, cum.tolist(), strict=True) if c < top_p]
    assert tokens <= set(kept)
    assert len(tokens) == len(kept)  # and every kept token shows up in 2000 draws


def test_hashed_uniform_is_in_the_open_unit_interval_and_looks_uniform():
    keys = torch.tensor([position_seed(s, 3) for s in range(64)])
    u = hashed_uniform(keys, 4096)
    assert u.dtype == torch.float32 and u.shape == (64, 4096)
    assert float(u.min()) > 0 and float(u.max()) < 1
    assert abs(float(u.mean()) - 0.5) < 0.01
    assert abs(float(u.var()) - 1 / 12) < 0.005
    assert not math.isclose(float(u[0, 0]), float(u[1, 0]))


# A (seed, position) whose hash at id 80 is the largest, 2**32 - 1 >> 8: in float32 its
# uniform ``(h + 0.5) / 2**24`` rounded to 1.0 (found by a hostile-input round: ids with
# hashes this high come up at about vocab / 2**24 of a row's steps -- ~1% on a 150k
# vocabulary).
TOP_SEED, TOP_POS, TOP_ID = 46881, 2, 80


def test_the_largest_hash_is_still_below_one():
    u = hashed_uniform(torch.tensor([position_seed(TOP_SEED, TOP_POS)]), 512)
    assert float(u.max()) < 1 and int(u.argmax()) == TOP_ID


@pytest.mark.parametrize(
    "fields",
    [
        {"allowed_token_ids": list(range(48, 58))},
        {"top_k": 1},
        {"top_p": 1e-9},
        {"min_p": 1.0},
        {"logit_bias": {str(TOP_ID): -100}},
        {"grammar": True},
    ],
)
def test_a_masked_id_with_the_largest_uniform_is_never_drawn(fields):
    """Its exponential was -log(1.0) = 0: ``p / E`` of a masked id (p = 0) was NaN, which
    ``argmax`` takes: the id outside the mask was drawn -- outside ``allowed_token_ids``,
    past top-k, top-p or min-p, against a grammar (the scheduler then failed the request:
    a 500 "output token 80 does not follow the structured output")."""
    import numpy as np

    from engine.structured.matcher import bitmask_words

    vocab = 512
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(0)) * 3
    logits[0, TOP_ID] = float(logits.min())  # the mask's and the filters' victim
    fields = dict(fields)
    grammar = None
    if fields.pop("grammar", False):  # digits only, as ``guided_regex: "[0-9]"`` masks
        grammar = np.zeros(bitmask_words(vocab) + 1, dtype=np.int32)
        grammar.view(np.uint32)[1] = sum(1 << (d - 32) for d in range(48, 58))
    if "logit_bias" in fields:
        fields["logit_bias"] = {int(k): v for k, v in fields["logit_bias"].items()}
    sp = SamplingParams(temperature=1.0, seed=TOP_SEED, **fields)
    (token,) = Sampler().sample(logits, [sp], [TOP_POS], grammar=grammar)
    assert token != TOP_ID
    if "allowed_token_ids" in fields or grammar is not None:
        assert 48 <= token < 58
    if fields.get("top_k") == 1 or "top_p" in fields or "min_p" in fields:
        assert token == int(logits.argmax())


@pytest.mark.parametrize("temperature", [1e-45, 1e-30, 1e-6])
def test_a_temperature_too_small_to_divide_by_samples_greedily(temperature):
    logits = _logits(3)
    params = [SamplingParams(temperature=temperature, seed=s) for s in range(3)]
    assert Sampler().sample(logits, params, [0, 1, 2]) == logits.argmax(-1).tolist()


def test_a_worker_error_survives_the_pipe():
    import pickle

    from engine.worker.worker_proc import WorkerError

    err = pickle.loads(pickle.dumps(WorkerError(1, "Traceback: boom")))
    assert isinstance(err, WorkerError) and err.rank == 1 and "boom" in str(err)


def test_logit_bias_moves_the_greedy_pick_and_only_its_own_row():
    logits = _logits(3)
    top = [int(r.argmax()) for r in logits]
    low = [int(r.argmin()) for r in logits]
    params = [
        SamplingParams(temperature=0, logit_bias={low[0]: 100.0}),  # the least likely wins
        SamplingParams(temperature=0),
        SamplingParams(temperature=0, logit_bias={top[2]: -100.0}),  # the argmax is banned
    ]
    out = Sampler().sample(logits, params, [0, 0, 0])
    assert out[0] == low[0] and out[1] == top[1]
    second = int(logits[2].topk(2).indices[1])
    assert out[2] == second


def test_logit_bias_shifts_the_sampled_law_and_stays_seeded():
    # A bias of log(4) on one token multiplies its odds by 4 (the law of softmax(x + b)).
    torch.manual_seed(2)
    row = torch.randn(VOCAB)
    n = 20_000
    bias = {7: math.log(4.0)}
    params = [SamplingParams(temperature=1.0, seed=s, logit_bias=bias) for s in range(n)]
    tokens = Sampler().sample(row.expand(n, VOCAB), params, [5] * n)
    counts = torch.bincount(torch.tensor(tokens), minlength=VOCAB).double()
    biased = row.double().clone()
    biased[7] += math.log(4.0)
    p = torch.softmax(biased, dim=-1)
    sigma = torch.sqrt(n * p * (1 - p))
    assert torch.all((counts - n * p).abs() <= 5 * sigma + 1), (counts, n * p)
    assert tokens == Sampler().sample(row.expand(n, VOCAB), params, [5] * n)  # (seed, position)


@pytest.mark.parametrize("top_k,top_p", [(-1, 1.0), (8, 0.9)])
def test_min_p_never_draws_a_token_below_its_share_of_the_top_probability(top_k, top_p):
    torch.manual_seed(3)
    row = torch.randn(VOCAB) * 2
    n = 4000
    min_p, temp = 0.1, 0.7
    params = [
        SamplingParams(temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p, seed=s)
        for s in range(n)
    ]
    tokens = set(Sampler().sample(row.expand(n, VOCAB), params, [1] * n))
    probs = torch.softmax(row / temp, dim=-1)  # min_p applies after the temperature (vLLM)
    kept = {t for t in range(VOCAB) if probs[t] >= min_p * probs.max()}
    assert tokens <= kept
    if top_k == -1:
        assert tokens == kept  # every token min_p keeps shows up in 4000 draws
    # A row without min_p in the same batch still draws outside that set.
    free = Sampler().sample(
        row.expand(n, VOCAB), [SamplingParams(temperature=temp, seed=s) for s in range(n)], [1] * n
    )
    assert set(free) - kept


def test_sampling_params_refuse_a_min_p_outside_0_1_and_a_non_finite_bias():
    from engine.sampling_params import InvalidRequestError

    for bad in (-0.1, 1.5):
        with pytest.raises(InvalidRequestError) as e:
            SamplingParams(min_p=bad)
        assert e.value.param == "min_p"
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(logit_bias={3: float("nan")})
    assert e.value.param == "logit_bias"


# -- allowed_token_ids -------------------------------------------------------------------------


def test_allowed_token_ids_confine_greedy_and_sampled_rows_and_only_their_own():
    torch.manual_seed(4)
    row = torch.randn(VOCAB) * 2
    order = torch.argsort(row, descending=True).tolist()
    allowed = order[-3:]  # the three least likely: never drawn without the mask
    n = 3000
    logits = row.expand(n, VOCAB).clone()
    params = [
        SamplingParams(temperature=1.0, seed=s, allowed_token_ids=allowed)
        if s % 3 == 0
        else SamplingParams(temperature=0)
        if s % 3 == 1
        else SamplingParams(temperature=1.0, seed=s, top_k=5)
        for s in range(n)
    ]
    params[1] = SamplingParams(temperature=0, allowed_token_ids=allowed)  # a greedy row
    out = Sampler().sample(logits, params, [2] * n)
    assert torch.equal(logits, row.expand(n, VOCAB))  # masked in a copy: logprobs stay raw
    confined = [t for s, t in enumerate(out) if s % 3 == 0]
    assert set(confined) == set(allowed)  # each allowed id shows up, nothing else
    assert out[1] == max(allowed, key=lambda t: float(row[t]))  # greedy: the best allowed
    # The rows without it are what a batch without any mask draws.
    free = [i for i in range(n) if i % 3 and i != 1]
    alone = Sampler().sample(logits[free], [params[i] for i in free], [2] * len(free))
    assert [out[i] for i in free] == alone
    assert out[4] == order[0]


def test_allowed_token_ids_draw_the_softmax_law_over_the_allowed_ids():
    torch.manual_seed(5)
    row = torch.randn(VOCAB)
    allowed = [3, 9, 17, 40]
    n = 20_000
    params = [SamplingParams(temperature=0.9, seed=s, allowed_token_ids=allowed) for s in range(n)]
    tokens = Sampler().sample(row.expand(n, VOCAB), params, [7] * n)
    counts = torch.bincount(torch.tensor(tokens), minlength=VOCAB).double()
    p = torch.zeros(VOCAB, dtype=torch.float64)
    p[allowed] = torch.softmax(row[allowed].double() / 0.9, dim=-1)
    sigma = torch.sqrt(n * p * (1 - p))
    assert torch.all((counts - n * p).abs() <= 5 * sigma + 1), (counts, n * p)


@pytest.mark.parametrize("temperature, seed", [(0.0, None), (1.0, 8)])
def test_allowed_token_ids_with_the_min_tokens_ban(temperature, seed):
    """The ban applies within the allowed ids; when it would leave none (every allowed id
    is an EOS or stop id), the allowed ids win: the row draws from them, no NaN, no id
    outside them (vLLM draws from an all -inf row: token 0)."""
    logits = torch.zeros(3, 10)
    logits[:, 4] = 5.0
    logits[:, 6] = 3.0
    logits[:, 2] = 1.0
    params = [
        SamplingParams(temperature=temperature, seed=seed, allowed_token_ids=[4, 6]),
        SamplingParams(temperature=temperature, seed=seed, allowed_token_ids=[4, 6]),
        SamplingParams(temperature=temperature, seed=seed, allowed_token_ids=[6, 6]),
    ]
    banned = [(4,), (4, 6, 9), (6,)]
    for pos in range(20):
        out = Sampler().sample(logits, params, [pos] * 3, banned)
        assert out[0] == 6  # 4 banned, 6 the only id left
        assert out[1] in (4, 6) and out[2] == 6  # all banned: the allowed ids still
    greedy = SamplingParams(temperature=0, allowed_token_ids=[4, 6])
    assert Sampler().sample(logits[:1], [greedy], [0], [(4, 6)]) == [4]  # the best of them


@pytest.mark.parametrize("neighbour", [{"top_k": 3}, {"top_p": 0.8}, {}])
def test_a_seeded_row_its_bans_left_empty_draws_token_0_whatever_runs_with_it(neighbour):
    """``bad_words`` that ban every allowed id leave the row all -inf: it draws token 0
    (vLLM's), alone and in any batch. It drew another id when a row of the step had
    top-k or top-p -- the sorted draw's first place among ties, which depends on the
    batch -- so the request's tokens depended on what ran with it (found by
    ``test_property_engine.py``)."""
    vocab = 512
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(1)) * 3
    empty = SamplingParams(temperature=2.0, seed=5, allowed_token_ids=[1], min_p=0.1)
    other = SamplingParams(temperature=1.0, seed=7, **neighbour)
    for pos in range(8):
        (alone,) = Sampler().sample(logits[:1], [empty], [pos], bad=[(1,)])
        batched = Sampler().sample(logits, [empty, other, other], [pos] * 3, bad=[(1,), (), ()])
        assert alone == batched[0] == 0, (pos, alone, batched)


def test_allowed_token_ids_stay_right_as_the_batch_changes_and_ids_past_the_vocabulary_go():
    """A request's ids go to the device once and are kept: rows move, requests come and
    go, a step without any leaves none kept, and the answers stay each row's own."""
    logits = _logits(3, seed=6)
    a = SamplingParams(temperature=0, allowed_token_ids=[1, 2])
    b = SamplingParams(temperature=0, allowed_token_ids=[30, 49, 10**6])  # 10**6: ignored
    plain = SamplingParams(temperature=0)

    def best(r: int, ids: list[int]) -> int:
        return max(ids, key=lambda t: float(logits[r, t]))

    sampler = Sampler()
    assert sampler.sample(logits, [a, plain, plain], [0] * 3)[0] == best(0, [1, 2])
    assert sampler.sample(logits, [plain, a, b], [0] * 3) == [
        int(logits[0].argmax()), best(1, [1, 2]), best(2, [30, 49])
    ]  # fmt: skip
    assert sampler.sample(logits, [plain] * 3, [0] * 3) == logits.argmax(-1).tolist()
    assert sampler.sample(logits, [b, b, a], [0] * 3) == [best(0, [30, 49]), best(1, [30, 49]), best(2, [1, 2])]  # fmt: skip


def test_allowed_token_ids_cost_one_host_to_device_copy_per_step_and_none_without(monkeypatch):
    import engine.worker.sampler as sampler_module

    copies: list[int] = []
    real = sampler_module._copy

    def counting(host, dev, staging):
        copies.append(host.numel())
        return real(host, dev, staging)

    monkeypatch.setattr(sampler_module, "_copy", counting)
    logits = _logits(4)
    plain = [SamplingParams(temperature=0)] * 4
    sampler = Sampler()
    sampler.sample(logits, plain, [0] * 4)
    assert copies == []  # greedy rows and nothing else: no copy at all
    rows = [
        SamplingParams(temperature=0, allowed_token_ids=list(range(t, 50, 7))) for t in range(3)
    ]
    sampler.sample(logits, [*rows, plain[0]], [0] * 4)
    assert len(copies) == 1  # three requests' ids (new) in one copy
    sampler.sample(logits, [plain[0], *rows], [0] * 4)
    assert len(copies) == 2 and copies[1] < copies[0]  # kept: only where they go this step


def test_sampling_params_check_allowed_token_ids():
    from engine.sampling_params import MAX_ALLOWED_TOKEN_IDS, InvalidRequestError

    assert SamplingParams(allowed_token_ids=[0, 5]).allowed_token_ids == [0, 5]
    for bad in ([], [-1], [1, -2], [0] * (MAX_ALLOWED_TOKEN_IDS + 1)):
        with pytest.raises(InvalidRequestError) as e:
            SamplingParams(allowed_token_ids=bad)
        assert e.value.param == "allowed_token_ids"
