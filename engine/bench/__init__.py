"""``pd-bench``: pdserve's own measuring tool (offline engine runs, HTTP serving load,
random benchmark checkpoints). See ``docs/performance.md``."""
