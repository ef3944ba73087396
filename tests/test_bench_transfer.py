"""pd-bench transfer: geometry, block ids, the data check, the report (in-process), and the
bench itself at toy sizes with real NIXL processes (slow), the --plot PNG. No timed
assertions."""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys

import pytest
import torch
from harness import REPO_ROOT

from engine.bench import transfer as tb
from engine.bench import transfer_ranks as tr
from engine.bench.cli import build_parser, main

TOY = ["--layers", "2", "--kv-heads", "2", "--head-dim", "16"]


# ---------------------------------------------------------------------------------------
# pure parts
# ---------------------------------------------------------------------------------------


def test_default_geometry_is_llama3_8b_128_kib_per_token():
    geo = tb.Geometry()
    assert geo.bytes_per_token == 128 * 1024
    assert geo.block_bytes(1) == 16 * 128 * 1024
    assert geo.block_bytes(2) == 8 * 128 * 1024  # each rank holds half the KV heads
    assert geo.rank_shape(2, 5) == (5, 32, 2, 4, 16, 128)  # [block, layer, kv, head, tok, dim]
    with pytest.raises(ValueError, match="--tp 3"):
        geo.heads_per_rank(3)
    with pytest.raises(ValueError, match="--dtype"):
        tb.Geometry(dtype="int8")
    # 8k tokens: 1 GiB per side; P's copy target makes it 3 GiB in all, whatever the TP
    assert tb.memory_needed(geo, [128, 8192]) == 3 * 2**30
    assert tb.num_blocks_for(8192, 16) == 512 and tb.num_blocks_for(17, 16) == 2


@pytest.mark.parametrize("layout", tb.DST_LAYOUTS)
def test_dst_block_ids_are_distinct_blocks_of_the_pool(layout):
    ids = tb.dst_block_ids(100, 300, layout, seed=1)
    assert len(ids) == 100 and len(set(ids)) == 100
    assert all(0 <= b < 300 for b in ids)
    assert ids == tb.dst_block_ids(100, 300, layout, seed=1)  # seeded
    runs = tb.count_runs(ids)
    if layout == "contiguous":
        assert ids == list(range(100)) and runs == 1
    elif layout == "runs":
        assert 100 / tb.RUN_MAX <= runs < 100
    else:
        assert runs > 50  # a shuffled free list: nearly every block its own descriptor
    with pytest.raises(ValueError):
        tb.dst_block_ids(301, 300, layout, seed=1)


def test_fill_pattern_differs_per_block_and_rank_and_check_blocks_catches_errors():
    geo = tb.Geometry(layers=2, kv_heads=2, head_dim=16)
    shape = geo.rank_shape(1, 8)
    src = torch.zeros(shape, dtype=torch.bfloat16)
    for b in range(8):
        tr.fill_pattern(src[b], seed=3, rank=0, block_id=b)
    as_bytes = [src[b].reshape(-1).view(torch.uint8) for b in range(8)]
    assert all(not torch.equal(as_bytes[0], as_bytes[b]) for b in range(1, 8))
    other_rank = torch.zeros_like(src[0])
    tr.fill_pattern(other_rank, seed=3, rank=1, block_id=0)
    assert not torch.equal(other_rank.reshape(-1).view(torch.uint8), as_bytes[0])
    assert torch.isnan(src.float()).any()  # so the check must compare bytes, not values

    dst_ids = [5, 2, 7, 0]
    dst = torch.zeros_like(src)
    for k, d in enumerate(dst_ids):
        dst[d] = src[k]
    good = tr.check_blocks(dst, dst_ids, [0, 1, 2, 3], seed=3, rank=0)
    assert good["ok"] and good["wrong_blocks"] == 0 and good["dirty_other_blocks"] == 0
    assert not tr.check_blocks(dst, dst_ids, [0, 1, 2, 3], seed=3, rank=1)["ok"]
    assert tr.check_blocks(dst, dst_ids, [1, 0, 2, 3], seed=3, rank=0)["wrong_blocks"] == 2

    flipped = dst.clone()
    flipped[7].view(-1).view(torch.uint8)[100] ^= 1  # one bit of one block
    bad = tr.check_blocks(flipped, dst_ids, [0, 1, 2, 3], seed=3, rank=0)
    assert not bad["ok"] and bad["wrong_blocks"] == 1 and bad["first_wrong"] == [2]

    stray = dst.clone()
    stray[4].view(-1).view(torch.uint8)[0] = 1  # a block nobody reserved was written
    assert tr.check_blocks(stray, dst_ids, [0, 1, 2, 3], seed=3, rank=0) == {
        **good,
        "dirty_other_blocks": 1,
        "ok": False,
    }


def _device_paths(device: str) -> None:
    geo = tb.Geometry(layers=2, kv_heads=2, head_dim=16)
    cache = torch.zeros(geo.rank_shape(2, 6), dtype=torch.bfloat16, device=device)
    for b in range(6):
        tr.fill_pattern(cache[b], seed=0, rank=1, block_id=b)
    scratch = torch.zeros_like(cache)
    t0, t1 = tr.timed_copy(scratch[:4], cache[:4])
    assert t1 >= t0
    assert torch.equal(
        scratch[:4].reshape(-1).view(torch.uint8), cache[:4].reshape(-1).view(torch.uint8)
    )
    assert not scratch[4:].reshape(-1).view(torch.uint8).any()
    assert tr.check_blocks(cache, [0, 1, 2, 3, 4, 5], list(range(6)), seed=0, rank=1)["ok"]


def test_copy_and_check_on_cpu():
    _device_paths("cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_copy_and_check_on_cuda():
    assert tr.rank_device("cuda", 3).startswith("cuda:")
    _device_paths("cuda")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_cuda_without_cuda_is_refused(capsys):
    with pytest.raises(tb.BenchError, match="CUDA is not available"):
        tr.rank_device("cuda", 0)
    assert main(["transfer", "--device", "cuda", *TOY, "--tokens", "16"]) == 2
    assert "CUDA is not available" in capsys.readouterr().err


def test_bad_flags_are_refused_with_the_flag_named(capsys):
    for argv, flag in (
        (["--tp", "3"], "--tp 3"),
        (["--tokens", "0"], "--tokens"),
        (["--reps", "0"], "--reps"),
        (["--layers", "0"], "--layers"),
    ):
        with pytest.raises(SystemExit) as e:
            main(["transfer", *argv])
        assert e.value.code == 2
        assert flag in capsys.readouterr().err


def _fake_row(tp: int, tokens: int) -> dict:
    nbytes = tokens * 256
    paths = {
        "connector": tb.path_stats([0.004, 0.002, 0.003], nbytes),
        "raw": tb.path_stats([0.002, 0.002], nbytes),
        "copy": tb.path_stats([0.001], nbytes),
    }
    return {
        "tp": tp,
        "tokens": tokens,
        "bytes_total": nbytes,
        "descriptors_per_rank": [3] * tp,
        "paths": paths,
        "ratio_connector_raw": paths["connector"]["gbps"] / paths["raw"]["gbps"],
        "ratio_connector_copy": paths["connector"]["gbps"] / paths["copy"]["gbps"],
        "data_ok": True,
    }


def test_path_stats_and_markdown_table():
    s = tb.path_stats([0.004, 0.002, 0.003], 3_000_000)
    assert s["median_s"] == 0.003 and s["min_s"] == 0.002 and s["max_s"] == 0.004
    assert s["gbps"] == pytest.approx(1.0) and s["gbps_best"] == pytest.approx(1.5)
    table = tb.markdown_table([_fake_row(1, 128), _fake_row(2, 8192)])
    lines = table.splitlines()
    assert lines[0].startswith("| TP | tokens |") and "connector/raw" in lines[0]
    assert len(lines) == 4 and all(ln.count("|") == 14 for ln in lines)
    assert "| 0.67 | 0.33 | ok |" in lines[2]  # connector/raw, connector/copy, data


PNG = b"\x89PNG\r\n\x1a\n"


def _fake_report(rows: list[dict]) -> dict:
    return {"memory": "DRAM", "geometry": tb.asdict(tb.Geometry()), "bytes_per_token": 131072,
            "commit": "abc1234", "results": rows}  # fmt: skip


def test_plot_from_a_stored_result_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    rows = [_fake_row(tp, t) for tp in (1, 2) for t in (128, 512, 2048)]
    out = tmp_path / "t.png"
    assert tb.plot_transfer(_fake_report(rows), str(out))
    assert out.read_bytes().startswith(PNG)


def test_plot_without_matplotlib_says_so(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    out = tmp_path / "t.png"
    assert not tb.plot_transfer(_fake_report([_fake_row(1, 128)]), str(out))
    assert "matplotlib is not installed" in capsys.readouterr().out and not out.exists()


def test_subcommand_is_registered_and_torch_free_to_parse():
    args = build_parser().parse_args(["transfer"])
    assert args.command == "transfer"
    assert args.tokens == [128, 512, 2048, 8192] and args.tp == [1, 2]
    assert args.device == "cpu" and args.dst_blocks == "shuffled" and args.verify
    geo = tb.validate(argparse.Namespace(**{**vars(args), "tp": [1, 2, 4, 8]}))
    assert geo == tb.Geometry()


# ---------------------------------------------------------------------------------------
# real processes, real NIXL
# ---------------------------------------------------------------------------------------

nixl_ok = pytest.importorskip("kvconnector.nixl.transport").NIXL_AVAILABLE


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.skipif(not nixl_ok, reason="nixl not installed")
def test_connector_path_puts_exactly_ps_bytes_into_ds_reserved_blocks():
    """Independent of the bench's own check: read both sides' bytes and compare."""
    geo = tb.Geometry(layers=2, kv_heads=2, head_dim=16)
    tp, pool, n = 2, 12, 5
    cfg = {
        "geometry": tb.asdict(geo),
        "tp": tp,
        "pool_blocks": pool,
        "device": "cpu",
        "seed": 7,
        "timeout": 30.0,
        "poll_us": 50.0,
        "copy_threads": 1,
        "run_id": "test",
    }
    dst = [9, 3, 4, 11, 0]  # non-contiguous, out of order
    procs = tb.RankProcs(cfg)
    try:
        procs.call_all("D", {"op": "zero"})
        m = procs.measure("connector", n, dst, tag="t-connector")
        assert m["seconds"] > 0 and m["descriptors"] == [tb.count_runs(dst)] * tp
        src_bytes = procs.call_all("P", {"op": "read", "ids": list(range(n))})
        d_bytes = procs.call_all("D", {"op": "read", "ids": list(range(pool))})
        for rank in range(tp):
            p_blocks, d_blocks = src_bytes[rank]["blocks"], d_bytes[rank]["blocks"]
            assert len(set(p_blocks)) == n  # every source block is different
            for k, d in enumerate(dst):
                assert d_blocks[d] == p_blocks[k], (rank, k, d)
            zero = bytes(geo.block_bytes(tp))
            assert all(d_blocks[b] == zero for b in range(pool) if b not in dst)
        assert src_bytes[0]["blocks"] != src_bytes[1]["blocks"]  # ranks hold other heads

        procs.call_all("P", {"op": "prepare_raw", "n": n})
        procs.call_all("D", {"op": "zero"})
        procs.measure("raw", n, dst, tag="t-raw")
        d_bytes = procs.call_all("D", {"op": "read", "ids": list(range(n))})
        for rank in range(tp):
            assert d_bytes[rank]["blocks"] == src_bytes[rank]["blocks"]
    finally:
        procs.close()
    assert procs.procs == {"P": [], "D": []}


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.skipif(not nixl_ok, reason="nixl not installed")
def test_cli_runs_all_three_paths_at_toy_sizes_tp1_tp2_and_writes_json(tmp_path):
    out, png = tmp_path / "transfer.json", tmp_path / "transfer.png"
    proc = subprocess.run(
        [sys.executable, "-m", "engine.bench", "transfer", *TOY, "--tokens", "40", "96"]
        + ["--tp", "1", "2", "--reps", "2", "--dst-blocks", "runs", "--json", str(out)]
        + ["--plot", str(png)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "| TP | tokens |" in proc.stdout
    report = json.loads(out.read_text())
    for key in ("commit", "device", "memory", "geometry", "bytes_per_token", "tokens", "tp"):
        assert key in report
    assert report["memory"] == "DRAM" and report["all_data_ok"] is True
    rows = report["results"]
    assert [(r["tp"], r["tokens"]) for r in rows] == [(1, 40), (1, 96), (2, 40), (2, 96)]
    for r in rows:
        blocks = tb.num_blocks_for(r["tokens"], 16)
        assert r["blocks_per_rank"] == blocks
        assert r["bytes_total"] == blocks * 16 * report["bytes_per_token"]
        assert len(r["descriptors_per_rank"]) == r["tp"]
        assert all(d == r["dst_runs"] for d in r["descriptors_per_rank"])
        for path in tb.PATHS:
            p = r["paths"][path]
            assert len(p["times_s"]) == 2 and all(t > 0 for t in p["times_s"])
            assert p["gbps"] > 0 and p["median_s"] > 0
            check = r["data"][path]
            assert check["ok"] and check["wrong_blocks"] == 0
            assert check["dirty_other_blocks"] == 0
            assert check["blocks_checked"] == blocks * r["tp"]
        assert r["ratio_connector_raw"] > 0 and r["ratio_connector_copy"] > 0
        assert r["data_ok"] is True
    if importlib.util.find_spec("matplotlib") is not None:
        assert png.read_bytes().startswith(PNG) and f"wrote {png}" in proc.stdout
