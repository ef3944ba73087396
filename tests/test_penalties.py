"""Presence, frequency and repetition penalties (``engine/worker/penalties.py``): the batched
application against a per-row reference, greedy generation against a step-by-step
reference on the transformers model's logits, and the same tokens with async scheduling,
chunked prefill, preemption and P/D (NIXL) as in one colocated run."""

from __future__ import annotations

import pytest
import torch
from hf_models import hf_logits, make_hf_model, random_prompt, save_hf_model

from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.sampling_params import InvalidRequestError, SamplingParams
from engine.worker.penalties import PenaltyHistory, apply_penalties
from engine.worker.sampler import Sampler

VOCAB = 40
PENALTIES = {"repetition_penalty": 1.6, "frequency_penalty": 0.7, "presence_penalty": 0.4}


def _to_device(host: torch.Tensor, dev: torch.device) -> torch.Tensor:
    return host.to(dev)


def reference(
    logits: torch.Tensor, sp: SamplingParams, prompt: list[int], output: list[int]
) -> torch.Tensor:
    """One row, written out: vLLM's (and OpenAI's) definitions."""
    x = logits.clone()
    for t in set(prompt) | set(output):
        x[t] = x[t] / sp.repetition_penalty if x[t] > 0 else x[t] * sp.repetition_penalty
    for t in set(output):
        x[t] -= sp.frequency_penalty * output.count(t) + sp.presence_penalty
    return x


def test_history_splits_prompt_and_output_across_messages():
    h = PenaltyHistory(num_prompt_tokens=5)
    h.add([1, 2, 3])
    h.add([3, 4, 7, 7])  # 2 prompt tokens, then output
    h.add([8, 7])
    assert h.prompt == {1, 2, 3, 4} and h.output == {7: 3, 8: 1} and h.num_seen == 9


def test_batched_penalties_equal_the_reference_row_by_row_and_leave_other_rows_alone():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, VOCAB, generator=gen) * 3
    params = [
        SamplingParams(temperature=0, **PENALTIES),
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.8, repetition_penalty=0.7, presence_penalty=-1.0),
        SamplingParams(temperature=0, frequency_penalty=2.0),
    ]
    prompts = [[1, 2, 3, 3], [], [5, 6], [9]]
    outputs = [[3, 4, 4, 4, 39], [], [6, 7], [1, 1]]
    pending_row, pending_id = 3, 12  # row 3's last output: sampled, not in its history yet
    histories: list[PenaltyHistory | None] = []
    for sp, pr, out in zip(params, prompts, outputs, strict=True):
        if not sp.has_penalties:
            histories.append(None)
            continue
        h = PenaltyHistory(len(pr))
        h.add(pr + out)
        histories.append(h)
    sampler = Sampler()
    pending = ([pending_row], [1], torch.tensor([5, pending_id]))
    got = apply_penalties(logits, params, histories, pending, _to_device, sampler.penalty_pool)
    outputs[pending_row] = [*outputs[pending_row], pending_id]
    for i, sp in enumerate(params):
        want = reference(logits[i], sp, prompts[i], outputs[i])
        torch.testing.assert_close(got[i], want)
    assert torch.equal(got[1], logits[1])
    # Through the sampler: greedy rows take the penalized argmax.
    picked = sampler.sample(logits, params, [0] * 4, None, histories, pending)
    assert picked[0] == int(reference(logits[0], params[0], prompts[0], outputs[0]).argmax())
    assert picked[1] == int(logits[1].argmax())


@pytest.mark.parametrize(
    "field,value", [("presence_penalty", 2.5), ("frequency_penalty", -3), ("repetition_penalty", 0)]
)
def test_penalties_out_of_range_are_refused_naming_the_field(field, value):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**{field: value})
    assert e.value.param == field


# -- engines (worker processes) --------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, str]:
    # Its greedy output tends to repeat one token: penalties change it.
    model = make_hf_model("qwen2_tied", seed=3)
    return model, save_hf_model(model, tmp_path_factory.mktemp("qwen2_pen"))


def reference_greedy(model: torch.nn.Module, prompt: list[int], sp: SamplingParams) -> list[int]:
    out: list[int] = []
    for _ in range(sp.max_tokens):
        row = hf_logits(model, prompt + out)[-1]
        out.append(int(reference(row, sp, prompt, out).argmax()))
    return out


def _config(path: str, **sched) -> EngineConfig:
    blocks = sched.pop("num_blocks", 256)
    return EngineConfig(
        model=ModelConfig(model=path, dtype="float32", max_model_len=min(256, 4 * blocks)),
        cache=CacheConfig(block_size=4, num_blocks=blocks),
        scheduler=SchedulerConfig(max_num_seqs=8, **sched),
    )


@pytest.mark.slow
def test_greedy_with_penalties_equals_the_step_by_step_reference_in_every_schedule(qwen):
    from engine.llm import LLM

    model, path = qwen
    vocab = model.config.vocab_size
    prompts = [random_prompt(n, vocab, seed=n) for n in (5, 19, 21)]
    sp = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, **PENALTIES)
    want = [reference_greedy(model, p, sp) for p in prompts]
    plain = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    want[1] = reference_greedy(model, prompts[1], plain)  # no penalties, in the same batch
    # The prompts fit 14 blocks, their answers do not (preempted).
    schedules = {
        "one step": {"async_scheduling": False},
        "async": {"async_scheduling": True},
        "chunked": {"max_num_batched_tokens": 8, "async_scheduling": False},
        "preempted": {"num_blocks": 14, "async_scheduling": False},
        "async chunked": {"max_num_batched_tokens": 8, "async_scheduling": True},
        "async preempted": {"num_blocks": 14, "async_scheduling": True},
    }
    for name, sched in schedules.items():
        with LLM(_config(path, **sched)) as llm:
            got = llm.generate_token_ids(prompts, [sp, plain, sp])
            assert got == want, name
            if name.endswith("preempted"):
                assert llm.core.stats()["num_preemptions_total"] > 0
    assert want[0] != reference_greedy(model, prompts[0], plain)  # the penalties mattered


@pytest.mark.slow
def test_pd_with_penalties_answers_what_a_colocated_engine_answers():
    """P samples the first token (repetition over the prompt), D the rest with P's token
    counted as output: together the colocated answer, greedy and seeded."""
    pytest.importorskip("nixl._api")
    from pd_utils import disagg_generate, nixl_config

    from engine.engine_core import EngineCore
    from engine.llm import LLM

    base = EngineConfig(model=ModelConfig(model="tiny"), cache=CacheConfig(num_blocks=96))
    prompts = [random_prompt(n, 256, seed=n) for n in (9, 40)]
    p = EngineCore(nixl_config(base, "producer"))
    d = EngineCore(nixl_config(base, "consumer"))
    try:
        for sp in (
            SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, **PENALTIES),
            SamplingParams(max_tokens=12, temperature=0.9, seed=4, ignore_eos=True, **PENALTIES),
        ):
            res = disagg_generate(p, d, prompts, sp, tag=f"t{sp.temperature}", timeout=180)
            with LLM(base) as llm:
                assert res["tokens"] == llm.generate_token_ids(prompts, sp)
        assert d.stats()["prompt_tokens_total"] == 0
    finally:
        p.shutdown()
        d.shutdown()
