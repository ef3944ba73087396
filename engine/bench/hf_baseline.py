"""``pd-bench offline --compare-hf``: the same prompts through transformers ``generate``
(greedy, one left-padded batch, same dtype and device), and how far its tokens agree."""

from __future__ import annotations

import time
from typing import Any


def run_hf(
    model_dir: str,
    dtype_name: str,
    device: str,
    prompts: list[list[int]],
    output_len: int,
    num_threads: int | None,
) -> dict[str, Any]:
    """transformers ``generate`` on the same prompts: greedy, exactly ``output_len`` new
    tokens, one left-padded batch. Returns timing, throughput and the generated tokens."""
    import torch
    import transformers

    if device == "cpu" and num_threads:
        torch.set_num_threads(num_threads)
    dtype = getattr(torch, dtype_name)
    transformers.utils.logging.disable_progress_bar()
    major = int(transformers.__version__.split(".")[0])
    kw = {"dtype": dtype} if major >= 5 else {"torch_dtype": dtype}
    dev = "cuda:0" if device == "cuda" else device
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, **kw).to(dev).eval()

    def batch(ps: list[list[int]]) -> tuple[Any, Any]:
        width = max(len(p) for p in ps)
        ids = torch.zeros(len(ps), width, dtype=torch.long)
        mask = torch.zeros(len(ps), width, dtype=torch.long)
        for i, p in enumerate(ps):  # left padding
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        return ids.to(dev), mask.to(dev)

    def generate(ps: list[list[int]], n: int) -> Any:
        ids, mask = batch(ps)
        with torch.inference_mode():
            return model.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=False,
                max_new_tokens=n,
                min_new_tokens=n,
                pad_token_id=0,
            )[:, ids.shape[1] :]

    def sync() -> None:
        if dev.startswith("cuda"):
            torch.cuda.synchronize()

    generate(prompts[:1], min(2, output_len))  # warm-up
    sync()
    t0 = time.perf_counter()
    out = generate(prompts, output_len)
    sync()
    elapsed = time.perf_counter() - t0
    tokens = out.tolist()
    n_out = sum(len(t) for t in tokens)
    n_in = sum(len(p) for p in prompts)
    model = None  # free it before the caller goes on
    if dev.startswith("cuda"):
        torch.cuda.empty_cache()
    return {
        "transformers_version": transformers.__version__,
        "elapsed_s": elapsed,
        "output_tokens": n_out,
        "output_tokens_per_s": n_out / elapsed,
        "total_tokens_per_s": (n_in + n_out) / elapsed,
        "threads": torch.get_num_threads() if device == "cpu" else None,
        "tokens": tokens,
    }


def first_prompt_match(a: list[int], b: list[int]) -> dict[str, Any]:
    prefix = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        prefix += 1
    return {"equal": a == b, "matching_prefix": prefix, "length": len(a)}
