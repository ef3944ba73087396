"""The host cost of structured outputs per engine step: filling the grammar bitmask of
``--rows`` constrained rows and advancing their matchers by one token (what the scheduler
adds to a step), for the byte vocabulary of ``tiny`` and a synthetic vocabulary of
``--vocab`` byte-string tokens. Prints microseconds per step.

    python scripts/bench_structured_mask.py --rows 8
"""

from __future__ import annotations

import argparse
import random
import time

import numpy as np

from engine.structured.compiler import GrammarCompiler
from engine.structured.matcher import GrammarState, fill_bitmask
from engine.structured.spec import StructuredOutput
from engine.tokenizer import ByteTokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
        "score": {"type": "number"},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "tags", "score", "ok"],
}


class _SyntheticVocab(ByteTokenizer):
    """Bytes, then ``extra`` random lowercase/punctuation strings of 2-8 bytes."""

    def __init__(self, extra: int) -> None:
        rng = random.Random(0)
        alphabet = 'abcdefghijklmnopqrstuvwxyz ",:{}[]0123456789'
        self._extra = [
            "".join(rng.choice(alphabet) for _ in range(rng.randint(2, 8))).encode()
            for _ in range(extra)
        ]

    def token_bytes(self, token_id: int) -> bytes:
        if token_id >= 258:
            return self._extra[token_id - 258]
        return super().token_bytes(token_id)

    @property
    def vocab_size(self) -> int:
        return 258 + len(self._extra)


def run(vocab: int, rows: int, steps: int) -> float:
    tok = ByteTokenizer() if vocab <= 512 else _SyntheticVocab(vocab - 258)
    compiler = GrammarCompiler(lambda: tok, max(vocab, 512))
    so = StructuredOutput.json_schema(SCHEMA)
    states = [GrammarState(compiler.new_matcher(so)) for _ in range(rows)]
    rng = np.random.default_rng(1)
    total = 0.0
    done = 0
    words = (compiler.vocab_size + 31) // 32
    for _ in range(steps):
        t0 = time.perf_counter()
        buf = fill_bitmask(list(enumerate(states)), compiler.vocab_size)
        total += time.perf_counter() - t0
        picks = []
        for j in range(rows):  # the sampler's pick (not timed): any allowed id
            bits = np.unpackbits(buf[j * words : (j + 1) * words].view(np.uint8), bitorder="little")
            picks.append(int(rng.choice(np.flatnonzero(bits[: compiler.vocab_size]))))
        t0 = time.perf_counter()
        for j, st in enumerate(states):
            st.accept(picks[j])
        total += time.perf_counter() - t0
        for j, st in enumerate(states):
            if st.finished:  # a new request in its place
                states[j] = GrammarState(compiler.new_matcher(so))
        done += 1
    return total / done * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--vocab", type=int, nargs="*", default=[512, 32768])
    args = ap.parse_args()
    for vocab in args.vocab:
        us = run(vocab, args.rows, args.steps)
        print(
            f"vocab {vocab}: {args.rows} rows, {us:.0f} us per step ({us / args.rows:.0f} per row)"
        )


if __name__ == "__main__":
    main()
