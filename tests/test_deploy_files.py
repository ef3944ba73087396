"""The deployment files under scripts/deploy, checked against the code they start.

* Every node and proxy command line in ``compose.yaml`` and the Kubernetes manifests is
  parsed by the real CLI parsers (a renamed or removed flag fails here), and the ports,
  health paths, side-channel settings, grace periods and proxy node URLs agree with it.
* The manifests pass a Kubernetes schema check (``kubernetes-validate``; no cluster).
* Every metric name in the Grafana dashboard's PromQL is exported by live nodes and a
  proxy after one P/D request (slow), and request logs carry the internal id, the client's
  label and the transfer id that joins the proxy's log line to the nodes' (slow).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import io
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
import yaml
from harness import GREEDY, MODEL, REPO_ROOT, Proc, wait_for
from prometheus_client.parser import text_string_to_metric_families

from proxy.dns import parse_dns_name

DEPLOY = REPO_ROOT / "scripts" / "deploy"
COMPOSE = DEPLOY / "compose.yaml"
K8S_DIR = DEPLOY / "k8s"
DASHBOARD = DEPLOY / "grafana" / "pdserve.json"
DOCKERFILE = DEPLOY / "Dockerfile"
PROGRAMS = {"prefill-node": "prefill", "decode-node": "decode", "pd-proxy": "proxy"}
MODULES = {"prefill_node": "prefill", "decode_node": "decode", "proxy": "proxy"}
METRIC_PREFIXES = ("vllm:", "pdserve_", "pdproxy_")
POD_IP = "10.1.2.3"  # stands in for $(POD_IP) (the downward API's status.podIP)


# -- parsing command lines with the real parsers ---------------------------------------------


@dataclass
class Command:
    role: str  # prefill | decode | proxy
    host: str
    port: int
    shutdown_timeout: float
    engine: Any = None  # EngineConfig of a node
    proxy: Any = None  # ProxyConfig of the proxy


def parse_command(argv: list[str], env: dict[str, str], where: str) -> Command:
    """``argv`` (a container's command) through the CLI parser of the program it runs."""
    prog, rest = Path(argv[0]).name, [str(a) for a in argv[1:]]
    if prog.startswith("python") and rest[:1] == ["-m"]:
        role = MODULES[rest[1]]
        rest = rest[2:]
    else:
        assert prog in PROGRAMS, f"{where}: unknown program {prog!r}"
        role = PROGRAMS[prog]
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            if role == "proxy":
                from proxy.cli import build_parser as proxy_parser
                from proxy.config import config_from_sources

                args = proxy_parser().parse_args(rest)
                assert args.command == "serve", f"{where}: pd-proxy {args.command}, not serve"
                cfg = config_from_sources(args, environ=env)
                return Command("proxy", cfg.host, cfg.port, cfg.shutdown_timeout, proxy=cfg)
            from engine.server.cli_args import parse_config
            from engine.server.node_main import build_parser as node_parser

            ns, config = parse_config(node_parser(role), rest)  # type: ignore[arg-type]
            return Command(role, ns.host, ns.port, ns.shutdown_timeout, engine=config)
    except SystemExit:
        pytest.fail(f"{where}: {argv} is refused by the {role} CLI: {err.getvalue().strip()}")
    except Exception as e:  # ProxyConfigError and friends
        pytest.fail(f"{where}: {argv} is refused by the {role} CLI: {e}")


def test_parse_command_refuses_unknown_flags() -> None:
    """The checks below would be worthless if a bad flag went through."""
    ok = parse_command(["prefill-node", "--model", "tiny", "--port", "8100"], {}, "t")
    assert (ok.role, ok.port, ok.engine.kv_transfer.kv_role) == ("prefill", 8100, "producer")
    for argv in (
        ["decode-node", "--no-such-flag", "1"],
        ["decode-node", "--kv-connector", "carrier-pigeon"],
        ["pd-proxy", "serve", "--prefill", "not-a-url", "--decode", "http://d:8200"],
    ):
        with pytest.raises(pytest.fail.Exception):
            parse_command(argv, {}, "t")


def console_scripts() -> set[str]:
    """The installed pdserve's commands (pyproject.toml's [project.scripts])."""
    eps = importlib.metadata.distribution("pdserve").entry_points
    return {ep.name for ep in eps if ep.group == "console_scripts"}


def _seconds(value: str | int | float) -> float:
    """A compose duration (``45s``, ``1m30s``, ``500ms``) in seconds."""
    if isinstance(value, int | float):
        return float(value)
    total = 0.0
    for num, unit in re.findall(r"(\d+(?:\.\d+)?)(ms|us|h|m|s)", value):
        total += float(num) * {"h": 3600, "m": 60, "s": 1, "ms": 1e-3, "us": 1e-6}[unit]
    return total


# -- docker compose ----------------------------------------------------------------------------

_INTERPOLATION = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::?-([^}]*))?\}")


def interpolate(value: Any) -> Any:
    """Compose's ``${VAR:-default}`` / ``${VAR}`` with no variable set: the defaults."""
    if isinstance(value, str):
        return _INTERPOLATION.sub(lambda m: m.group(2) or "", value)
    if isinstance(value, list):
        return [interpolate(v) for v in value]
    if isinstance(value, dict):
        return {k: interpolate(v) for k, v in value.items()}
    return value


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    with open(COMPOSE) as f:
        return interpolate(yaml.safe_load(f))


def compose_commands(compose: dict[str, Any]) -> dict[str, Command]:
    out = {}
    for name, svc in compose["services"].items():
        cmd = svc.get("command")
        if not cmd:
            continue
        env = {k: str(v) for k, v in (svc.get("environment") or {}).items()}
        out[name] = parse_command(cmd, env, f"compose.yaml service {name}")
    return out


def _host_port(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    assert parts.hostname and parts.port, url
    return parts.hostname, parts.port


def test_compose_commands_parse_and_agree(compose: dict[str, Any]) -> None:
    services = compose["services"]
    cmds = compose_commands(compose)
    assert sorted(c.role for c in cmds.values()) == ["decode", "prefill", "proxy"]
    scripts = console_scripts()
    for name, c in cmds.items():
        svc = services[name]
        assert svc["command"][0] in scripts, f"{name}: {svc['command'][0]} is no console script"
        assert c.host == "0.0.0.0", f"{name}: must bind 0.0.0.0 to be reachable from the others"
        published = [str(p).rsplit(":", 1)[-1] for p in svc.get("ports", [])]
        assert published == [str(c.port)], f"{name}: publishes {published}, listens on {c.port}"
        probe = " ".join(svc["healthcheck"]["test"])
        assert f"http://127.0.0.1:{c.port}/health" in probe, f"{name}: healthcheck {probe}"
        grace = _seconds(svc["stop_grace_period"])
        assert grace > c.shutdown_timeout, f"{name}: stop_grace_period {grace}s cuts the drain"
        assert svc.get("stop_signal", "SIGTERM") == "SIGTERM"
        assert svc.get("networks") == ["pd"]
        build = svc["build"]
        assert (COMPOSE.parent / build["context"]).resolve() == REPO_ROOT
        assert (REPO_ROOT / build["dockerfile"]).resolve() == DOCKERFILE
        if c.role == "proxy":
            continue
        kv = c.engine.kv_transfer
        assert kv.kv_connector == "nixl", name
        assert kv.kv_role == {"prefill": "producer", "decode": "consumer"}[c.role]
        # The advertised side channel must resolve in the other containers: the service's
        # own name, put in its /etc/hosts by `hostname:`.
        assert kv.side_channel_host == svc["hostname"] == name
        assert kv.side_channel_port != 0, f"{name}: fix the side-channel port"
        env = svc["environment"]
        assert "tcp" in env["UCX_TLS"].split(","), f"{name}: UCX needs tcp between containers"
        assert env["UCX_NET_DEVICES"] == "eth0"
        assert "PDSERVE_API_KEY" in env
    (proxy_name, proxy), *_ = [(n, c) for n, c in cmds.items() if c.role == "proxy"]
    for role, urls in (("prefill", proxy.proxy.prefill), ("decode", proxy.proxy.decode)):
        for url in urls:
            host, port = _host_port(url)
            assert host in cmds, f"proxy {role} URL {url}: no service {host}"
            assert (cmds[host].role, cmds[host].port) == (role, port), url
    raw = yaml.safe_load(COMPOSE.read_text())["services"]
    assert raw[proxy_name]["environment"]["PDPROXY_NODE_API_KEY"] == "${PDSERVE_API_KEY:-}"


def test_compose_monitoring_files(compose: dict[str, Any]) -> None:
    cmds = compose_commands(compose)
    services = compose["services"]
    for name in ("prometheus", "grafana"):
        assert services[name]["profiles"] == ["monitoring"]
        for vol in services[name]["volumes"]:
            src = vol.split(":")[0]
            assert (COMPOSE.parent / src).exists(), f"{name}: mounts missing {src}"
    prom = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    targets = {t for job in prom["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}  # fmt: skip
    assert targets == {f"{n}:{c.port}" for n, c in cmds.items()}
    assert all(job.get("metrics_path", "/metrics") == "/metrics" for job in prom["scrape_configs"])
    provisioning = DEPLOY / "grafana" / "provisioning"
    ds = yaml.safe_load((provisioning / "datasources" / "pdserve.yaml").read_text())
    assert ds["datasources"][0]["url"] == "http://prometheus:9090"
    dash = yaml.safe_load((provisioning / "dashboards" / "pdserve.yaml").read_text())
    mounted = [v for v in services["grafana"]["volumes"] if v.startswith("./grafana/pdserve.json")]
    assert mounted and mounted[0].split(":")[1].startswith(dash["providers"][0]["options"]["path"])


# -- Kubernetes ----------------------------------------------------------------------------------


def k8s_docs() -> list[tuple[str, dict[str, Any]]]:
    docs = []
    for path in sorted(K8S_DIR.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        docs += [(path.name, d) for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def test_kustomization_lists_every_manifest() -> None:
    kust = yaml.safe_load((K8S_DIR / "kustomization.yaml").read_text())
    files = {p.name for p in K8S_DIR.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kust["resources"]) == files


def test_k8s_schema() -> None:
    kv = pytest.importorskip("kubernetes_validate")
    for name, doc in k8s_docs():
        try:
            kv.validate(doc, kv.latest_version(), strict=True)
        except kv.ValidationError as e:
            pytest.fail(f"{name} {doc['kind']}/{doc['metadata']['name']}: {e}")


def _container_env(container: dict[str, Any]) -> dict[str, str]:
    """Name -> value as the container will see it (secrets: empty; the pod IP: POD_IP)."""
    env = {}
    for e in container.get("env", []):
        if "value" in e:
            env[e["name"]] = str(e["value"])
        elif e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "status.podIP":
            env[e["name"]] = POD_IP
        else:
            assert e["valueFrom"]["secretKeyRef"].get("optional") is True, e["name"]
            env[e["name"]] = ""
    return env


def _expand(arg: str, env: dict[str, str], where: str) -> str:
    """Kubernetes' ``$(VAR)`` expansion in command/args; every reference must be defined."""
    for ref in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", arg):
        assert ref in env, f"{where}: $({ref}) is not in the container's env"
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env[m.group(1)], arg)


@dataclass
class Workload:
    file: str
    doc: dict[str, Any]
    container: dict[str, Any]
    cmd: Command

    @property
    def pod(self) -> dict[str, Any]:
        return self.doc["spec"]["template"]

    def port_number(self, port: int | str) -> int:
        if isinstance(port, int):
            assert any(p["containerPort"] == port for p in self.container["ports"]), port
            return port
        (number,) = [p["containerPort"] for p in self.container["ports"] if p["name"] == port]
        return number


def k8s_workloads() -> Iterator[Workload]:
    for file, doc in k8s_docs():
        if doc["kind"] not in ("Deployment", "StatefulSet"):
            continue
        (container,) = doc["spec"]["template"]["spec"]["containers"]
        env = _container_env(container)
        where = f"{file} {doc['kind']}/{doc['metadata']['name']}"
        argv = [_expand(a, env, where) for a in [*container["command"], *container["args"]]]
        yield Workload(file, doc, container, parse_command(argv, env, where))


def test_k8s_commands_parse_and_agree() -> None:
    workloads = list(k8s_workloads())
    assert sorted(w.cmd.role for w in workloads) == ["decode", "prefill", "proxy"]
    scripts = console_scripts()
    for w in workloads:
        c, box, spec = w.cmd, w.container, w.pod["spec"]
        where = f"{w.file} {w.doc['metadata']['name']}"
        assert box["command"][0] in scripts, where
        assert c.host == "0.0.0.0", where
        assert w.port_number("http") == c.port, f"{where}: port 'http' is not --port {c.port}"
        ready = box["readinessProbe"]["httpGet"]
        assert ready["path"] == "/health" and w.port_number(ready["port"]) == c.port, where
        live = box["livenessProbe"]
        assert w.port_number(live["httpGet"]["port"]) == c.port, where
        pre_stop = box.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command")
        pre_stop_s = float(pre_stop[1]) if pre_stop and pre_stop[0] == "sleep" else 0.0
        grace = spec["terminationGracePeriodSeconds"]
        assert grace >= pre_stop_s + c.shutdown_timeout, f"{where}: grace {grace}s cuts the drain"
        notes = w.pod["metadata"]["annotations"]
        assert notes["prometheus.io/scrape"] == "true", where
        assert notes["prometheus.io/port"] == str(c.port), where
        assert notes["prometheus.io/path"] == "/metrics", where
        if c.role == "proxy":
            # Nodes being down makes the proxy's /health 503: that must not restart it.
            assert live["httpGet"]["path"] == "/metrics", where
            continue
        assert w.doc["kind"] == "StatefulSet", f"{where}: stable pod DNS names for the nodes"
        # /health is 503 while draining: liveness must outlast the drain.
        assert live["httpGet"]["path"] == "/health", where
        budget = live.get("periodSeconds", 10) * live.get("failureThreshold", 3)
        assert budget > c.shutdown_timeout, f"{where}: liveness kills a draining node"
        assert box["startupProbe"]["httpGet"]["path"] == "/health", where
        kv = c.engine.kv_transfer
        assert kv.kv_connector == "nixl", where
        assert kv.side_channel_host == POD_IP, f"{where}: advertise the pod IP"
        assert w.port_number("side-channel") == kv.side_channel_port != 0, where
        env = _container_env(box)
        assert "tcp" in env["UCX_TLS"].split(","), where
        assert "PDSERVE_API_KEY" in env, where
        mounts = {m["mountPath"] for m in box["volumeMounts"]}
        assert "/dev/shm" in mounts, f"{where}: TP workers need more than 64 MiB of /dev/shm"


def test_k8s_services_and_proxy_urls() -> None:
    workloads = list(k8s_workloads())
    services = {d["metadata"]["name"]: d for _, d in k8s_docs() if d["kind"] == "Service"}

    def selected(svc: dict[str, Any]) -> list[Workload]:
        sel = svc["spec"]["selector"].items()
        return [w for w in workloads if sel <= w.pod["metadata"]["labels"].items()]

    for name, svc in services.items():
        (w,) = selected(svc)  # each Service fronts exactly one workload
        for port in svc["spec"]["ports"]:
            w.port_number(port["targetPort"])  # names or numbers a container port
        if w.doc["kind"] == "StatefulSet":
            assert w.doc["spec"]["serviceName"] == name
            assert svc["spec"]["clusterIP"] == "None", f"{name}: pod DNS names need headless"
            assert svc["spec"]["publishNotReadyAddresses"] is True
    (proxy,) = [w for w in workloads if w.cmd.role == "proxy"]
    cfg = proxy.cmd.proxy
    for role, names in (("prefill", cfg.prefill_dns), ("decode", cfg.decode_dns)):
        # The proxy finds the nodes through their headless Service (DNS discovery).
        assert names or getattr(cfg, role), f"the proxy has no {role} node source"
        for text in names:
            svc_name, port = parse_dns_name(text)
            svc = services[svc_name.split(".")[0]]
            assert svc["spec"]["clusterIP"] == "None", f"{text}: A records per pod need headless"
            (node,) = selected(svc)
            assert node.cmd.role == role and port == node.cmd.port, text
    for role, urls in (("prefill", cfg.prefill), ("decode", cfg.decode)):
        for url in urls:
            host, port = _host_port(url)
            pod, _, svc_name = host.partition(".")
            (node,) = [w for w in workloads if w.doc["metadata"]["name"] == pod.rsplit("-", 1)[0]]
            assert node.cmd.role == role, url
            assert node.doc["spec"]["serviceName"] == svc_name.split(".")[0], url
            assert int(pod.rsplit("-", 1)[1]) < node.doc["spec"]["replicas"], url
            assert port == node.cmd.port, url


# -- Dockerfile ----------------------------------------------------------------------------------


def test_dockerfile_copies_what_exists() -> None:
    text = DOCKERFILE.read_text()
    copies = re.findall(r"^COPY\s+(.+)\s+\S+$", text, re.M)
    assert copies
    for line in copies:
        for src in line.split():
            assert (REPO_ROOT / src).exists(), f"Dockerfile copies missing {src}"
    include = re.search(
        r"\[tool\.setuptools\.packages\.find\]\s*include\s*=\s*\[([^\]]*)\]",
        (REPO_ROOT / "pyproject.toml").read_text(),
    )
    assert include
    for package in re.findall(r'"(\w+)\*?"', include.group(1)):
        assert f"COPY {package} " in text, f"Dockerfile misses package {package}"
    ignore = (DEPLOY / "Dockerfile.dockerignore").read_text().split()
    assert "**" in ignore and "!engine" in ignore and "!pyproject.toml" in ignore


def test_the_image_serves_structured_outputs() -> None:
    """vLLM's image answers response_format / guided_* / a named or "required" tool
    choice; the default image here answered each with a 400 saying `pip install
    'pdserve[structured]'`, which a container's user cannot follow (a walkthrough)."""
    extras = re.search(r"^ARG EXTRAS=(\S*)$", DOCKERFILE.read_text(), re.M)
    assert extras
    assert {"nixl", "structured"} <= set(extras.group(1).split(","))
    optional = re.search(
        r"\[project\.optional-dependencies\](.*?)\n\[",
        (REPO_ROOT / "pyproject.toml").read_text(),
        re.S,
    )
    assert optional
    for extra in extras.group(1).split(","):
        assert re.search(rf"^{extra} = ", optional.group(1), re.M), extra


# -- the Grafana dashboard -----------------------------------------------------------------------

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_LABEL_LIST = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_KEYWORDS = {"and", "or", "unless", "bool", "offset", "inf", "nan"}


def promql_metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (not functions, labels or keywords)."""
    s = _STRING.sub('""', expr)
    s = re.sub(r"\{[^}]*\}", " ", s)  # label matchers
    s = re.sub(r"\[[^\]]*\]", " ", s)  # range selectors
    s = _LABEL_LIST.sub(" ", s)  # by (le, instance), on (...), ...
    names = set()
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", s):
        before = s[m.start() - 1] if m.start() else " "
        if before.isdigit() or before in ".$":  # 1e-9, $variable
            continue
        if s[m.end() :].lstrip().startswith("("):  # a function or aggregation
            continue
        if m.group().lower() not in _KEYWORDS:
            names.add(m.group())
    return names


def test_promql_metric_names() -> None:
    assert promql_metric_names(
        'histogram_quantile(0.99, sum by (le, instance) (rate(a_bucket{instance=~"$i"}[$__rate_interval])))'
    ) == {"a_bucket"}
    assert promql_metric_names(
        'rate(vllm:x_total{model_name=~"$m"}[5m]) / clamp_min(b_sum, 1e-9) > bool 0'
    ) == {"vllm:x_total", "b_sum"}
    assert promql_metric_names("sum without (url) (c) and on (role) d offset 5m") == {"c", "d"}


def _panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for p in panels:
        yield p
        yield from _panels(p.get("panels", []))


def dashboard_metric_names() -> set[str]:
    dash = json.loads(DASHBOARD.read_text())
    names: set[str] = set()
    for p in _panels(dash["panels"]):
        for t in p.get("targets", []):
            names |= promql_metric_names(t["expr"])
    for var in dash["templating"]["list"]:
        if var["type"] == "query":
            m = re.fullmatch(r"label_values\(\s*([A-Za-z_:][A-Za-z0-9_:]*)\s*,\s*\w+\s*\)",
                             var["query"]["query"])  # fmt: skip
            assert m, var["query"]
            names.add(m.group(1))
    return names


def test_dashboard_json() -> None:
    dash = json.loads(DASHBOARD.read_text())
    panels = list(_panels(dash["panels"]))
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    variables = {v["name"] for v in dash["templating"]["list"]}
    assert {"datasource", "instance", "model_name"} <= variables
    for p in panels:
        if p["type"] == "row":
            continue
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        assert p["targets"], p["title"]
        for t in p["targets"]:
            assert t["expr"] and t["datasource"]["uid"] == "${datasource}", p["title"]
    names = dashboard_metric_names()
    odd = sorted(n for n in names if not n.startswith(METRIC_PREFIXES))
    assert not odd, f"not metric names (a PromQL parsing gap?): {odd}"
    # What the issue asks the dashboard to show: transfer bytes, times, failures, load.
    for needed in (
        "pdserve_engine_kv_bytes_sent_total",
        "pdserve_kv_transfer_duration_seconds_bucket",
        "pdserve_engine_kv_transfer_failures_total",
        "vllm:num_requests_running",
        "vllm:kv_cache_usage_perc",
    ):
        assert needed in names, needed


# -- live: a P/D pair and a proxy ----------------------------------------------------------------


def exported_names(text: str) -> set[str]:
    """Every series name a /metrics page offers: its samples, and for families with no
    sample yet (a labelled counter before its first event) the names its type implies."""
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}
    names = set()
    for family in text_string_to_metric_families(text):
        names.update(s.name for s in family.samples)
        names.update(family.name + s for s in suffixes.get(family.type, ("",)))
    return names


@pytest.fixture(scope="module")
def pd_proxy(pd_pair, module_procs) -> Proc:
    return module_procs.proxy([pd_pair.p.url], [pd_pair.d.url])


def _complete(url: str, label: str) -> httpx.Response:
    body = {"model": MODEL, "prompt": "deploy files " * 6, "max_tokens": 4, **GREEDY}
    resp = httpx.post(
        url + "/v1/completions", json=body, headers={"X-Request-Id": label}, timeout=120
    )
    assert resp.status_code == 200, resp.text
    return resp


def test_dashboard_metrics_are_exported(pd_pair, pd_proxy) -> None:
    _complete(pd_proxy.url, "dash-1")
    exported: set[str] = set()
    for proc in (pd_pair.p, pd_pair.d, pd_proxy):
        assert httpx.get(proc.url + "/health", timeout=10).status_code == 200, proc.name
        page = httpx.get(proc.url + "/metrics", timeout=10)
        assert page.status_code == 200, proc.name
        exported |= exported_names(page.text)
    missing = sorted(dashboard_metric_names() - exported)
    assert not missing, f"the dashboard queries series no node or proxy exports: {missing}"
    # The transfer panels have data after one request.
    assert pd_pair.p.metric("pdserve_engine_kv_bytes_sent_total") > 0
    assert pd_pair.p.metric("pdserve_kv_transfer_duration_seconds_count") >= 1


def test_request_logs_carry_internal_id_label_and_transfer(pd_pair, pd_proxy) -> None:
    label = "deploy-log-label"
    _complete(pd_proxy.url, label)
    # The proxy's line names the label and the transfer id it gave this attempt ...
    proxy_line = re.compile(rf"request {label}: completions via .* transfer ({label}-[0-9a-f]+)\)")
    wait_for(lambda: proxy_line.search(pd_proxy.logs(200_000)), 10, "the proxy's request line")
    transfer = proxy_line.search(pd_proxy.logs(200_000)).group(1)  # type: ignore[union-attr]
    # ... and each node's line its own engine id, the label and that transfer id.
    node_line = re.compile(
        rf"request ({label}-[0-9a-f]{{12}}) \(label {label}, transfer {re.escape(transfer)}\)"
    )
    ids = set()
    for node in (pd_pair.p, pd_pair.d):
        wait_for(lambda n=node: node_line.search(n.logs(200_000)), 10, f"{node.name}'s line")
        ids.add(node_line.search(node.logs(200_000)).group(1))  # type: ignore[union-attr]
    assert len(ids) == 2, "prefill and decode legs have their own engine ids"
    # A request straight to a node: the id it answers in X-PDServe-Request-Id is logged.
    resp = _complete(pd_pair.d.url, "direct-label")
    engine_id = resp.headers["X-PDServe-Request-Id"]
    assert engine_id.startswith("direct-label-")
    wait_for(
        lambda: f"request {engine_id} (label direct-label): " in pd_pair.d.logs(200_000),
        10,
        "the node's request line",
    )
