"""The harness itself: what a test's processes leave behind."""

from __future__ import annotations

import pytest

from tests.harness import MODEL


@pytest.mark.slow
def test_a_node_killed_with_sigkill_leaves_no_temporary_directory_behind(procs):
    # A SIGKILLed process cannot remove what it made under the temporary directory
    # (multiprocessing's pymp-* folders); the harness gives each process its own and
    # removes it once the process is gone.
    node = procs.node("--model", MODEL, "--num-blocks", "64")
    tmp = node.tmpdir
    assert tmp is not None and tmp.is_dir()
    assert any(tmp.iterdir()), "the node made nothing in its temporary directory"
    node.kill9()
    assert not tmp.exists()
