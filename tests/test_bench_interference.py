"""pd-bench interference: the window, goodput and ratio arithmetic, the layouts' commands,
the report and plot (in-process), and the --smoke form with real processes (slow): both
layouts start, serve through their proxy and stop. No timed assertions."""

from __future__ import annotations

import importlib.util
import json
import math
import socket
import subprocess
import sys
from urllib.parse import urlparse

import pytest
from harness import REPO_ROOT

from engine.bench import interference as ib
from engine.bench import interference_report as rep
from engine.bench.cli import build_parser, main
from engine.bench.stats import RequestResult

PNG = b"\x89PNG\r\n\x1a\n"
HAVE_MPL = importlib.util.find_spec("matplotlib") is not None


def _r(start: float, ttft: float, itl: list[float], ok: bool = True) -> RequestResult:
    return RequestResult(
        ok=ok,
        prompt_tokens=8,
        output_tokens=len(itl) + 1,
        ttft=ttft,
        itl=itl,
        e2e=ttft + sum(itl),
        start=start,
        error=None if ok else "boom",
    )


# ---------------------------------------------------------------------------------------
# arithmetic
# ---------------------------------------------------------------------------------------


def test_token_times_and_the_gaps_inside_the_window():
    r = _r(start=1.0, ttft=0.5, itl=[0.25, 0.25, 1.0, 0.5])
    assert rep.token_times(r) == [1.5, 1.75, 2.0, 3.0, 3.5]
    # gaps ending at 1.75, 2.0, 3.0, 3.5: inside [1.8, 3.0] only those ending at 2.0 and 3.0
    assert rep.itl_in_window([r], 1.8, 3.0) == [0.25, 1.0]
    assert rep.itl_in_window([r], 0.0, 10.0) == r.itl
    assert rep.itl_in_window([r], 4.0, 5.0) == []
    failed = _r(start=0.0, ttft=0.1, itl=[0.1], ok=False)
    assert rep.itl_in_window([failed], 0.0, 10.0) == []  # a failed request's gaps never count
    assert rep.token_times(RequestResult()) == []


def test_goodput_counts_requests_meeting_both_slos_per_second():
    results = [
        _r(0, 0.10, [0.02, 0.03]),  # good
        _r(0, 0.90, [0.02]),  # TTFT too high
        _r(0, 0.10, [0.02, 0.20]),  # one gap too long
        _r(0, 0.50, [0.05]),  # good: both SLOs are inclusive
        _r(0, 0.10, [0.01], ok=False),  # failed: never good
    ]
    good, rate = rep.goodput(results, 2.0, slo_ttft_ms=500, slo_itl_ms=50)
    assert (good, rate) == (2, pytest.approx(1.0))
    assert rep.goodput(results, 2.0, slo_ttft_ms=500, slo_itl_ms=None)[0] == 3  # ITL unchecked
    assert rep.goodput(results, 2.0, slo_ttft_ms=None, slo_itl_ms=50)[0] == 3  # TTFT unchecked
    good, rate = rep.goodput(results, 4.0, None, None)  # no SLO: every completed request
    assert (good, rate) == (4, pytest.approx(1.0))


def test_ratio_is_none_when_a_side_is_missing_or_zero():
    assert rep.ratio(3.0, 6.0) == 0.5
    assert rep.ratio(0.0, 2.0) == 0.0
    for a, b in ((1.0, 0.0), (None, 1.0), (1.0, None), (math.nan, 1.0), (1.0, math.inf)):
        assert rep.ratio(a, b) is None


def _run(ttft_long: float, decode_gap: float) -> rep.LayoutRun:
    # the streams run from 0 to 4 s; long prompts from 1 s to 3 s
    decode = [_r(0.0, 0.05, [decode_gap] * 10), _r(2.0, 0.05, [0.01] * 10)]
    long = [_r(1.0, ttft_long, [0.01, 0.01]), _r(1.5, ttft_long, [0.01])]
    return rep.LayoutRun(long=long, decode=decode, window=(1.0, 3.0), duration_s=4.0)


def _report(**layouts: rep.LayoutRun) -> dict:
    out = {name: rep.layout_report(run, 400.0, 100.0) for name, run in layouts.items()}
    return {
        "model": "tiny",
        "device": "cpu",
        "commit": "abc1234",
        "slo": {"ttft_ms": 400.0, "itl_ms": 100.0},
        "layouts": out,
        "ratios": rep.ratios(out),
    }


def test_layout_report_headline_ratios_and_table():
    pd = _run(ttft_long=0.3, decode_gap=0.02)
    colo = _run(ttft_long=0.2, decode_gap=0.2)  # prefills stall the colocated decodes
    report = _report(pd=pd, colocated=colo)
    h_pd, h_colo = (report["layouts"][n]["headline"] for n in ("pd", "colocated"))
    assert h_pd["completed"] == h_colo["completed"] == 4 and h_pd["failed"] == 0
    # the first stream's gaps end at 0.07 .. 0.25 (P/D) or 0.25 .. 2.05 (colocated)
    assert h_pd["decode_itl_window_p99_ms"] == pytest.approx(10.0)  # only the 2nd stream's
    assert h_colo["decode_itl_window_p99_ms"] == pytest.approx(200.0)
    assert h_pd["long_ttft_p99_ms"] == pytest.approx(300.0, abs=1.0)
    # goodput: colocated's first stream misses the ITL SLO -> 3 of 4 good over 4 s
    assert (h_pd["good_requests"], h_pd["goodput_rps"]) == (4, pytest.approx(1.0))
    assert (h_colo["good_requests"], h_colo["goodput_rps"]) == (3, pytest.approx(0.75))
    rat = report["ratios"]
    assert rat["decode_itl_window_p99_ms"] == pytest.approx(0.05)
    assert rat["goodput_rps"] == pytest.approx(4 / 3)
    assert rat["failed"] is None  # 0 / 0
    samples = report["layouts"]["pd"]["samples"]
    assert len(samples["long_ttft_ms"]) == 2 and len(samples["decode_ttft_ms"]) == 2
    kinds = [r["kind"] for r in report["layouts"]["pd"]["requests"]]
    assert kinds == ["long", "long", "decode", "decode"]

    table = rep.markdown_table(report).splitlines()
    assert table[0].startswith("| metric | P/D (1 P + 1 D) | colocated (2 nodes) |")
    assert "P/D ÷ colocated" in table[0]
    assert len(table) == 2 + len(rep.ROWS) and all(ln.count("|") == 5 for ln in table)
    itl_row = next(ln for ln in table if ln.startswith("| ITL p99, ongoing"))
    assert itl_row.endswith("| 10.0 | 200.0 | 0.05 |")
    assert any("TTFT <= 400 ms, max ITL <= 100 ms" in ln for ln in table)
    json.dumps(ib.json_safe(report))  # JSON-safe (NaN written as null)

    one = _report(colocated=colo)  # a single layout: no ratio column
    assert one["ratios"] == {}
    assert all(ln.count("|") == 3 for ln in rep.markdown_table(one).splitlines())


@pytest.mark.skipif(not HAVE_MPL, reason="matplotlib not installed")
def test_plot_from_a_report_writes_a_png(tmp_path):
    report = _report(pd=_run(0.3, 0.02), colocated=_run(0.2, 0.2))
    out = tmp_path / "i.png"
    assert rep.plot_interference(report, str(out))
    assert out.read_bytes().startswith(PNG)


def test_plot_without_matplotlib_says_so(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    out = tmp_path / "i.png"
    assert not rep.plot_interference(_report(pd=_run(0.3, 0.02)), str(out))
    assert "matplotlib is not installed" in capsys.readouterr().out
    assert not out.exists()


def test_route_modes_and_hop_means_are_read_from_metrics_text(monkeypatch):
    import httpx

    text = "\n".join(
        [
            "# HELP pdproxy_route_mode_total Attempts routed",
            'pdproxy_route_mode_total{mode="disaggregated"} 7.0',
            'pdproxy_route_mode_total{mode="decode_only"} 0.0',
            "pdserve_kv_load_wait_seconds_sum 3.0",
            "pdserve_kv_load_wait_seconds_count 2.0",
            'pdserve_engine_kv_transfer_duration_seconds_sum{rank="0"} 0.5',
            'pdserve_engine_kv_transfer_duration_seconds_sum{rank="1"} 0.5',
            'pdserve_engine_kv_transfer_duration_seconds_count{rank="0"} 2.0',
            'pdserve_engine_kv_transfer_duration_seconds_count{rank="1"} 2.0',
            "pdserve_kv_notif_to_step_seconds_sum 0.0",
            "pdserve_kv_notif_to_step_seconds_count 0.0",
            "pdserve_request_seconds_sum 9.0",
        ]
    )

    class Resp:
        pass

    resp = Resp()
    resp.text = text
    monkeypatch.setattr(httpx, "get", lambda *a, **k: resp)
    assert ib.route_modes("http://x") == {"disaggregated": 7.0, "decode_only": 0.0}
    assert ib.kv_hop_means("http://x") == {
        "kv_load_wait_seconds": {"mean_ms": 1500.0, "count": 2.0},
        "kv_transfer_duration_seconds": {"mean_ms": 250.0, "count": 4.0},
    }  # a hop with no observations is left out; other histograms are not hops

    def refuse(*a, **k):
        raise httpx.ConnectError("refused")

    monkeypatch.setattr(httpx, "get", refuse)
    assert ib.route_modes("http://x") == {} and ib.kv_hop_means("http://x") == {}


# ---------------------------------------------------------------------------------------
# flags and the layouts' commands
# ---------------------------------------------------------------------------------------


def _args(*argv: str):
    args = build_parser().parse_args(["interference", *argv])
    ib.resolve(args)
    ib.validate(args)
    return args


def test_defaults_smoke_and_explicit_flags_win():
    args = _args()
    assert args.command == "interference" and args.model == "tiny" and args.device == "cpu"
    assert args.layouts == ["pd", "colocated"]
    assert args.long_len == ib.DEFAULTS["long_len"] and args.duration_s == 20.0
    assert args.num_long is None and args.slo_ttft_ms == 1000.0 and args.slo_itl_ms == 100.0
    smoke = _args("--smoke", "--decode-streams", "3")
    assert smoke.num_long == 3 and smoke.long_len == ib.SMOKE["long_len"]
    assert smoke.decode_streams == 3  # given explicitly: wins over --smoke
    assert smoke.duration_s is None  # --num-long decides
    assert len(ib.long_arrivals(smoke)) == 3
    timed = _args("--long-rate", "2", "--duration-s", "5")
    arrivals = ib.long_arrivals(timed)
    assert arrivals[0] == 0.0 and all(t < 5 for t in arrivals) and len(arrivals) > 1
    assert ib.long_arrivals(_args("--long-rate", "inf", "--num-long", "4")) == [0.0] * 4


def test_bad_flags_are_refused_with_the_flag_named(capsys):
    for argv, flag in (
        (["--long-rate", "0"], "--long-rate"),
        (["--long-len", "0"], "--long-len"),
        (["--num-long", "0"], "--num-long"),
        (["--slo-itl-ms", "-1"], "--slo-itl-ms"),
        (["--gpu-per-node"], "--gpu-per-node"),
        (["--long-rate", "inf"], "--num-long"),
        (["--num-long", "2", "--duration-s", "3"], "--duration-s"),  # one or the other
    ):
        with pytest.raises(SystemExit) as e:
            main(["interference", *argv])
        assert e.value.code == 2
        assert flag in capsys.readouterr().err


def test_layout_commands_same_budget_and_colocated_through_the_proxy_alone():
    args = _args(
        "--tp", "2", "--num-blocks", "64", "--node-arg=--max-num-seqs=8",
        "--prefill-arg=--kv-layer-group-size=2", "--decode-arg=--kv-pipeline-wait-ms=5",
        "--colocated-arg=--max-num-batched-tokens=512", "--proxy-arg=--max-retries=0",
    )  # fmt: skip
    pd = ib.layout_plan("pd", args)
    colo = ib.layout_plan("colocated", args)
    assert [m for _, m, _ in pd] == ["prefill_node", "decode_node"]
    assert [m for _, m, _ in colo] == ["decode_node", "decode_node"]
    for _, _, argv in pd + colo:  # the same hardware budget: every node gets the same flags
        assert argv[:6] == ["--model", "tiny", "--device", "cpu", "--tp", "2"]
        assert "--num-blocks" in argv and "--max-num-seqs=8" in argv
    for _, _, argv in pd:
        assert argv[argv.index("--kv-connector") + 1] == "nixl"
    assert "--kv-layer-group-size=2" in pd[0][2] and "--kv-layer-group-size=2" not in pd[1][2]
    assert "--kv-pipeline-wait-ms=5" in pd[1][2]
    for _, _, argv in colo:
        assert "--kv-connector" not in argv and "--max-num-batched-tokens=512" in argv

    urls = ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    p = ib.proxy_argv("pd", urls, args)
    assert p[0] == "serve" and p[p.index("--prefill") + 1] == urls[0]
    assert p[p.index("--decode") + 1] == urls[1] and "--disagg-min-prompt-tokens" not in p
    c = ib.proxy_argv("colocated", urls, args)
    assert "--prefill" not in c and c[c.index("--decode") + 1 : c.index("--decode") + 3] == urls
    assert int(c[c.index("--disagg-min-prompt-tokens") + 1]) >= 10**9
    assert "--registration-key" in c and p[-1] == c[-1] == "--max-retries=0"
    shown = ib._shown_cmd(["/usr/bin/python3", "-m", "proxy", *c])
    assert shown[0] == "python3" and shown[shown.index("--registration-key") + 1] == "<hidden>"
    # Keys a user passes through --proxy-arg are hidden too (they reached the JSON report).
    shown = ib._shown_cmd(["python", "--api-key", "k1", "--node-api-key=k2", "--kv-secret", "k3"])
    assert not {"k1", "k2", "k3"} & {part for a in shown for part in a.split("=")}, shown
    assert "--node-api-key=<hidden>" in shown

    gpu = _args("--device", "cuda", "--tp", "2", "--gpu-per-node")
    assert ib._gpu_env(0, gpu) == {"CUDA_VISIBLE_DEVICES": "0,1"}
    assert ib._gpu_env(1, gpu) == {"CUDA_VISIBLE_DEVICES": "2,3"}
    assert ib._gpu_env(1, args) is None


# ---------------------------------------------------------------------------------------
# --smoke: real nodes, real proxies, real NIXL
# ---------------------------------------------------------------------------------------

nixl_ok = pytest.importorskip("kvconnector.nixl.transport").NIXL_AVAILABLE


def _refuses(url: str) -> bool:
    u = urlparse(url)
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex((u.hostname, u.port)) != 0


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.skipif(not nixl_ok, reason="nixl not installed")
def test_smoke_runs_both_layouts_and_writes_json_and_png(tmp_path):
    out, png = tmp_path / "i.json", tmp_path / "i.png"
    proc = subprocess.run(
        [sys.executable, "-m", "engine.bench", "interference", "--smoke"]
        + ["--json", str(out), "--plot", str(png), "--log-dir", str(tmp_path / "logs")],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "| metric | P/D (1 P + 1 D) | colocated (2 nodes) | P/D ÷ colocated |" in proc.stdout
    report = json.loads(out.read_text())
    assert report["command"] == "interference" and report["workload"]["smoke"] is True
    assert set(report["layouts"]) == {"pd", "colocated"}
    for name, lay in report["layouts"].items():
        h = lay["headline"]
        assert h["failed"] == 0 and h["completed"] >= 3 + 2, name  # 3 long + >= 1 per stream
        assert lay["long"]["completed"] == 3 and lay["decode"]["completed"] >= 2
        assert h["decode_itl_window_p99_ms"] is not None and h["long_ttft_p99_ms"] is not None
        assert h["goodput_rps"] is not None and h["good_requests"] <= h["completed"]
        assert len(lay["samples"]["long_ttft_ms"]) == 3
        for node in lay["nodes"]:  # every process was stopped: its port refuses
            port = node["cmd"][node["cmd"].index("--port") + 1]
            assert _refuses(f"http://127.0.0.1:{port}"), node["name"]
    # the requests took the path each layout claims (the proxies' own counters)
    pd_modes = report["layouts"]["pd"]["proxy_route_modes"]
    colo_modes = report["layouts"]["colocated"]["proxy_route_modes"]
    assert pd_modes["disaggregated"] > 0 and pd_modes["decode_only"] == 0
    assert colo_modes["decode_only"] > 0 and colo_modes["disaggregated"] == 0
    hops = report["layouts"]["pd"]["kv_hops"]  # P/D's nodes moved KV; colocated has none
    assert hops["pd-decode"]["kv_load_wait_seconds"]["count"] >= 3 + 2
    assert hops["pd-prefill"]["kv_transfer_duration_seconds"]["count"] >= 3 + 2
    assert report["layouts"]["colocated"]["kv_hops"] == {}
    assert [n["name"] for n in report["layouts"]["colocated"]["nodes"]] == [
        "colocated-colocated0", "colocated-colocated1", "colocated-proxy",
    ]  # fmt: skip
    assert set(report["ratios"]) == {key for key, _, _ in rep.ROWS}
    if HAVE_MPL:
        assert png.read_bytes().startswith(PNG)


def test_the_clusters_processes_do_not_inherit_the_users_keys(tmp_path, monkeypatch):
    """A user's PDSERVE_API_KEY made the private cluster's nodes refuse its proxy (which was
    not given the key): every request failed. Keys for a run go in its flags."""
    from engine.bench.cluster import Cluster

    monkeypatch.setenv("PDSERVE_API_KEY", "node-key")
    monkeypatch.setenv("PDPROXY_API_KEY", "proxy-key")
    monkeypatch.setenv("PDSERVE_PORT_RANGE_KEEP", "1")
    env = Cluster(tmp_path, env={"A": "1"}).child_env({"B": "2"})
    assert "PDSERVE_API_KEY" not in env and "PDPROXY_API_KEY" not in env
    assert env["PDSERVE_PORT_RANGE_KEEP"] == "1" and env["A"] == "1" and env["B"] == "2"
