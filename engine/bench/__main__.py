"""``python -m engine.bench`` is ``pd-bench``."""

from engine.bench.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
