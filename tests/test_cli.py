"""Node CLI: flags derived from the config dataclasses; bad values exit 2 naming the flag."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from engine.config import EngineConfig
from engine.server.cli_args import add_config_args, add_server_args, config_from_args, parse_config
from engine.server.node_main import build_parser


def _run(*argv: str, module: str = "decode_node") -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", module, *argv],
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--block-size", "3"], "--block-size"),
        (["--tp", "0"], "--tp"),
        (["--model", "/nonexistent"], "--model"),
        (["--max-num-seqs", "abc"], "--max-num-seqs"),
        (["--device", "tpu"], "--device"),
        (["--kv-memory-fraction", "2"], "--kv-memory-fraction"),
        (["--port", "70000"], "--port"),
    ],
)
def test_bad_flag_exits_2_naming_it(argv: list[str], flag: str) -> None:
    proc = _run(*argv)
    assert proc.returncode == 2, proc.stderr
    assert flag in proc.stderr
    # The error is not buried under the usage of every flag: one usage line, then it.
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 2 and "--help" in lines[0] and flag in lines[1], proc.stderr


def test_prefill_node_bad_flag() -> None:
    proc = _run("--tp", "0", module="prefill_node")
    assert proc.returncode == 2 and "--tp" in proc.stderr


@pytest.mark.parametrize("module", ["prefill_node", "decode_node"])
def test_help(module: str) -> None:
    proc = _run("--help", module=module)
    assert proc.returncode == 0, proc.stderr
    for flag in (
        "--tp",
        "--device",
        "--dtype",
        "--block-size",
        "--num-blocks",
        "--kv-memory-fraction",
        "--max-num-seqs",
        "--max-num-batched-tokens",
        "--model",
        "--host",
        "--port",
        "--log-level",
        "--kv-connector",
        "--side-channel-host",
        "--side-channel-port",
        "--kv-transfer-timeout",
        "--kv-failure-policy",
        "--no-enable-prefix-caching",
    ):
        assert flag in proc.stdout, flag


def test_role_defaults() -> None:
    _, cfg = parse_config(build_parser("prefill"), [])
    assert cfg.kv_transfer.kv_role == "producer" and cfg.kv_transfer.kv_connector == "none"
    _, cfg = parse_config(build_parser("decode"), [])
    assert cfg.kv_transfer.kv_role == "consumer"
    _, cfg = parse_config(build_parser("decode"), ["--kv-role", "both"])
    assert cfg.kv_transfer.kv_role == "both"


def test_flags_map_to_config() -> None:
    parser = add_config_args(add_server_args(argparse.ArgumentParser()))
    args, cfg = parse_config(
        parser,
        [
            "--tp", "2",
            "--dtype", "bfloat16",
            "--block-size", "32",
            "--num-blocks", "100",
            "--max-num-seqs", "8",
            "--max-num-batched-tokens", "512",
            "--max-model-len", "1024",
            "--no-enable-prefix-caching",
            "--kv-connector", "nixl",
            "--side-channel-port", "5600",
            "--kv-transfer-timeout", "2.5",
            "--kv-failure-policy", "fail",
            "--port", "9000",
            "--log-level", "debug",
        ],
    )  # fmt: skip
    assert (args.port, args.host, args.log_level) == (9000, "127.0.0.1", "DEBUG")
    assert cfg.parallel.tp == 2 and cfg.model.dtype == "bfloat16"
    assert cfg.model.max_model_len == 1024
    assert cfg.cache.block_size == 32 and cfg.cache.num_blocks == 100
    assert not cfg.cache.enable_prefix_caching
    assert cfg.scheduler.max_num_seqs == 8 and cfg.scheduler.max_num_batched_tokens == 512
    kv = cfg.kv_transfer
    assert kv.kv_connector == "nixl" and kv.side_channel_port == 5600
    assert kv.kv_transfer_timeout == 2.5 and kv.kv_failure_policy == "fail"


def test_unset_flags_keep_dataclass_defaults() -> None:
    parser = add_config_args(argparse.ArgumentParser())
    cfg = config_from_args(parser.parse_args([]))
    default = EngineConfig()
    assert cfg.cache == default.cache and cfg.scheduler == default.scheduler
    assert cfg.parallel == default.parallel and cfg.model == default.model
    assert len(cfg.kv_transfer.engine_id) == 12  # default_factory still applies


# -- vLLM's spellings: -tp / --tensor-parallel-size, a positional model, --config FILE -------


@pytest.mark.parametrize("spelling", ["--tp", "--tensor-parallel-size", "-tp"])
def test_tensor_parallel_size_aliases(spelling: str) -> None:
    _, cfg = parse_config(build_parser("decode"), [spelling, "2"])
    assert cfg.parallel.tp == 2


@pytest.mark.parametrize("spelling, dtype", [("half", "float16"), ("float", "float32")])
def test_vllm_dtype_spellings_half_and_float(spelling: str, dtype: str, tmp_path) -> None:
    # vLLM's --dtype takes half and float besides float16 and float32 (its docs' --dtype
    # half for GPUs without bfloat16); they were an "invalid choice" here.
    _, cfg = parse_config(build_parser("decode"), ["--dtype", spelling])
    assert cfg.model.dtype == dtype
    yaml = tmp_path / "node.yaml"
    yaml.write_text(f"dtype: {spelling}\n")
    _, cfg = parse_config(build_parser("prefill"), ["--config", str(yaml)])
    assert cfg.model.dtype == dtype


def test_positional_model(tmp_path) -> None:
    _, cfg = parse_config(build_parser("decode"), ["Qwen/Qwen2.5-0.5B-Instruct", "--tp", "2"])
    assert cfg.model.model == "Qwen/Qwen2.5-0.5B-Instruct" and cfg.parallel.tp == 2
    _, cfg = parse_config(build_parser("prefill"), [str(tmp_path)])
    assert cfg.model.model == str(tmp_path)
    _, cfg = parse_config(build_parser("decode"), ["tiny", "--model", "tiny"])  # agreeing
    assert cfg.model.model == "tiny"


def test_positional_and_flag_model_disagree_exits_2() -> None:
    proc = _run("org/a", "--model", "org/b")
    assert proc.returncode == 2 and "--model" in proc.stderr


def test_config_file(tmp_path) -> None:
    path = tmp_path / "node.yaml"
    path.write_text(
        "max-num-seqs: 8\n"
        "max_num_batched_tokens: 512\n"
        "tensor-parallel-size: 2\n"
        "enable-prefix-caching: false\n"
        "kv_connector: nixl\n"
        "kv-transfer-timeout: 2.5\n"
        "port: 9001\n"
        "log-level: debug\n"
        "model: org/name\n"
        "num-blocks: null\n"
    )
    args, cfg = parse_config(build_parser("decode"), ["--config", str(path)])
    assert cfg.scheduler.max_num_seqs == 8 and cfg.scheduler.max_num_batched_tokens == 512
    assert cfg.parallel.tp == 2 and not cfg.cache.enable_prefix_caching
    assert cfg.kv_transfer.kv_connector == "nixl" and cfg.kv_transfer.kv_transfer_timeout == 2.5
    assert cfg.kv_transfer.kv_role == "consumer" and cfg.cache.num_blocks is None
    assert (args.port, args.log_level) == (9001, "DEBUG") and cfg.model.model == "org/name"
    # Command-line flags (and a positional model) win over the file.
    args, cfg = parse_config(
        build_parser("decode"),
        ["org/other", "--config", str(path), "--max-num-seqs", "4", "--port", "9002", "-tp", "1"],
    )
    assert cfg.scheduler.max_num_seqs == 4 and cfg.parallel.tp == 1 and args.port == 9002
    assert cfg.model.model == "org/other" and cfg.scheduler.max_num_batched_tokens == 512


@pytest.mark.parametrize(
    "argv, file, on",
    [
        ([], None, True),  # vLLM's default: on
        (["--async-scheduling"], None, True),
        (["--no-async-scheduling"], None, False),
        ([], "async-scheduling: false\n", False),
        ([], "async-scheduling: null\n", True),  # null: the flag's default
        (["--async-scheduling"], "async_scheduling: false\n", True),  # the command line wins
    ],
)
def test_async_scheduling_is_on_unless_turned_off(tmp_path, argv, file, on) -> None:
    if file is not None:
        path = tmp_path / "node.yaml"
        path.write_text(file)
        argv = [*argv, "--config", str(path)]
    for role in ("prefill", "decode"):
        _, cfg = parse_config(build_parser(role), argv)
        assert cfg.scheduler.async_scheduling is on, (role, argv, file)


def test_a_side_channel_port_in_use_exits_2_naming_it_not_a_traceback() -> None:
    # Two nodes given one --side-channel-port (or one VLLM_NIXL_SIDE_CHANNEL_PORT): the
    # second's connector could not bind and the node printed a zmq traceback (exit 1).
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = str(busy.getsockname()[1])
        proc = _run(
            "--model", "tiny", "--port", "0", "--kv-connector", "nixl",
            "--side-channel-port", port, module="prefill_node",
        )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "prefill-node: error: --side-channel-port" in proc.stderr
    assert f"127.0.0.1:{port}" in proc.stderr and "Address already in use" in proc.stderr


def test_config_file_switches_without_a_no_spelling(tmp_path) -> None:
    # --trust-remote-code, --trust-request-chat-template, --disable-log-requests take no
    # value on the command line; in a file they were "invalid value True" (a vLLM config
    # with 'trust-remote-code: true' did not start). true is the flag given, false the
    # flag left out (vLLM's reading of such a file).
    path = tmp_path / "node.yaml"
    path.write_text(
        "trust-remote-code: true\ntrust-request-chat-template: true\ndisable-log-requests: true\n"
    )
    args, _ = parse_config(build_parser("decode"), ["--config", str(path)])
    assert args.trust_remote_code and args.trust_request_chat_template
    assert args.log_requests is False
    path.write_text("trust-request-chat-template: false\ndisable-log-requests: false\n")
    args, _ = parse_config(build_parser("decode"), ["--config", str(path)])
    assert args.trust_request_chat_template is False and args.log_requests is True
    path.write_text("trust-remote-code: 1\n")  # a switch takes true or false only
    with pytest.raises(SystemExit):
        parse_config(build_parser("decode"), ["--config", str(path)])


@pytest.mark.parametrize(
    "text, needle",
    [
        ("bogus-setting: 1\n", "unknown setting 'bogus-setting'"),
        ("max-num-seqs: abc\n", "--max-num-seqs"),
        ("max-num-seqs: 1.5\n", "--max-num-seqs"),
        ("device: tpu\n", "--device"),
        ("enable-prefix-caching: maybe\n", "--enable-prefix-caching"),
        ("block-size: 3\n", "--block-size"),  # the config's own check
        ("- a\n- b\n", "--config"),
        ("key: [unclosed\n", "--config"),
    ],
)
def test_bad_config_file_exits_2_naming_the_setting(tmp_path, text: str, needle: str) -> None:
    path = tmp_path / "node.yaml"
    path.write_text(text)
    proc = _run("--config", str(path))
    assert proc.returncode == 2, proc.stderr
    assert needle in proc.stderr


def test_missing_config_file_exits_2() -> None:
    proc = _run("--config", "/nonexistent/node.yaml")
    assert proc.returncode == 2 and "--config" in proc.stderr


@pytest.mark.slow  # starts an engine and its worker
def test_a_max_model_len_the_kv_cache_cannot_hold_exits_2_naming_it() -> None:
    proc = _run("--model", "tiny", "--max-model-len", "4096", "--num-blocks", "8", "--port", "0")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "--max-model-len 4096 does not fit the KV cache" in proc.stderr
    assert "hold 128 tokens" in proc.stderr and "Traceback" not in proc.stderr


def _checkpoint_dir(path, config: dict, tokenizer: bool = True) -> str:
    import json

    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    if tokenizer:
        from tokenizers import Tokenizer, models

        Tokenizer(models.BPE()).save(str(path / "tokenizer.json"))
    return str(path)


_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 512,
    "max_position_embeddings": 2048,
}


@pytest.mark.parametrize(
    "case, needle",
    [
        ("tp", "--tp 3: num_attention_heads=4 is not divisible by 3"),
        ("architecture", "architecture 'GPT2LMHeadModel' is not supported"),
        ("tokenizer", "has no tokenizer.json"),
        ("weights", "has no *.safetensors weights"),
    ],
)
def test_a_model_the_engine_cannot_run_exits_2_with_one_line_not_a_traceback(
    tmp_path, case: str, needle: str
) -> None:
    # These were found only when the engine started, and came out as a Python traceback
    # (ModelConfigError / FileNotFoundError were not the ConfigError run_node reports).
    if case == "tp":
        argv = ["--model", "tiny", "--tp", "3"]
    elif case == "architecture":
        gpt2 = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}
        argv = ["--model", _checkpoint_dir(tmp_path / "gpt2", gpt2)]
    elif case == "tokenizer":
        argv = ["--model", _checkpoint_dir(tmp_path / "llama", _LLAMA, tokenizer=False)]
    else:  # a worker found it while loading: two tracebacks, the worker's inside the engine's
        llama = _checkpoint_dir(tmp_path / "llama", _LLAMA)
        (tmp_path / "llama" / "pytorch_model.bin").write_bytes(b"")
        argv = ["--model", llama]
    proc = _run(*argv, "--port", "0")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "decode-node: error: " in proc.stderr and needle in proc.stderr, proc.stderr[-2000:]


@pytest.mark.skipif(
    __import__("engine.device").device.detect_device() == "cuda", reason="this host has a GPU"
)
def test_device_cuda_without_a_gpu_exits_2_with_one_line_not_a_traceback() -> None:
    # The worker's placement error ("needs 1 CUDA GPUs ... sees 0") came out inside the
    # executor's RuntimeError traceback.
    proc = _run("--model", "tiny", "--device", "cuda", "--port", "0")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "decode-node: error: " in proc.stderr and "CUDA" in proc.stderr, proc.stderr[-2000:]


@pytest.mark.skipif(
    __import__("engine.device").device.detect_device() == "cuda", reason="this host has a GPU"
)
@pytest.mark.parametrize("backend", ["mp", "uni"])
def test_an_offline_engine_on_cuda_without_a_gpu_is_a_config_error(backend: str) -> None:
    from engine.config import ConfigError, EngineConfig, ParallelConfig
    from engine.llm import LLM

    cfg = EngineConfig(parallel=ParallelConfig(device="cuda", distributed_executor_backend=backend))
    with pytest.raises(ConfigError, match="CUDA"):
        LLM(cfg)


def test_a_max_model_len_past_the_models_positions_needs_vllms_override(monkeypatch) -> None:
    """vLLM refuses a --max-model-len past max_position_embeddings (positions the model was
    never trained at give wrong tokens, no error) unless VLLM_ALLOW_LONG_MAX_MODEL_LEN=1;
    it was accepted silently."""
    proc = _run("--model", "tiny", "--max-model-len", "100000", "--port", "0")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "--max-model-len 100000 is more than" in proc.stderr, proc.stderr[-2000:]
    assert "VLLM_ALLOW_LONG_MAX_MODEL_LEN=1" in proc.stderr

    from engine.config import CacheConfig, EngineConfig, ModelConfig
    from engine.engine_core import EngineCore

    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    cfg = EngineConfig(
        model=ModelConfig(model="tiny", max_model_len=8192), cache=CacheConfig(num_blocks=600)
    )
    core = EngineCore(cfg)
    try:
        assert core.max_model_len == 8192
    finally:
        core.shutdown()


@pytest.mark.parametrize(
    ("text", "tokens"),
    [("32k", 32000), ("32K", 32768), ("25.6k", 25600), ("1M", 1 << 20), ("4096", 4096)],
)
def test_max_model_len_takes_vllms_human_readable_sizes(tmp_path, text: str, tokens: int):
    """vLLM's --max-model-len and --max-num-batched-tokens take k/m/g (powers of 1000) and
    K/M/G (powers of 1024); "32k" was an invalid int here."""
    _, cfg = parse_config(
        build_parser("decode"), ["--max-model-len", text, "--max-num-batched-tokens", text]
    )
    assert cfg.model.max_model_len == tokens
    assert cfg.scheduler.max_num_batched_tokens == tokens
    config = tmp_path / "node.yaml"
    config.write_text(f"max-model-len: {text}\n")
    _, cfg = parse_config(build_parser("decode"), ["--config", str(config)])
    assert cfg.model.max_model_len == tokens


@pytest.mark.parametrize("text", ["32x", "1.5K", "k", "-2k", "0.0001k"])
def test_a_size_that_is_no_whole_number_of_tokens_is_refused(text: str):
    with pytest.raises(SystemExit) as exc:
        parse_config(build_parser("decode"), ["--max-model-len", text])
    assert exc.value.code == 2


@pytest.mark.parametrize("flag", ["--api-k", "--max-model", "--gpu-memory=0.5"])
def test_an_abbreviated_flag_is_refused_not_taken_for_the_long_one(flag: str) -> None:
    # argparse takes '--api-k' for '--api-key' by default; the launch scripts (which look
    # for --api-key to probe the node's health) and a reader of the command would not.
    with pytest.raises(SystemExit) as exc:
        build_parser("decode").parse_args([flag, "1"] if "=" not in flag else [flag])
    assert exc.value.code == 2


def test_an_abbreviated_proxy_flag_is_refused() -> None:
    from proxy.cli import build_parser as proxy_parser

    with pytest.raises(SystemExit) as exc:
        proxy_parser().parse_args(["serve", "--api-k", "secret"])
    assert exc.value.code == 2
    args = proxy_parser().parse_args(["serve", "--api-key", "secret"])
    assert args.api_key == "secret"


@pytest.mark.parametrize("command", ["complete", "chat"])
def test_proxy_client_help_shows_its_defaults(command: str) -> None:
    # `pd-proxy complete --help` said "tokens to generate" and "sampling temperature" with no
    # default: 128 tokens at temperature 0.7 came as a surprise.
    from proxy.cli import build_parser as proxy_parser

    parser = proxy_parser()
    sub = parser._subparsers._group_actions[0].choices[command]
    text = " ".join(sub.format_help().split())
    for flag in ("--max-tokens", "--temperature", "--timeout"):
        default = sub.get_default(flag.lstrip("-").replace("-", "_"))
        assert f"(default: {default:g})" in text, (flag, text)


@pytest.mark.parametrize("module", ["decode_node.cli", "prefill_node.cli"])
def test_the_cli_modules_run_as_scripts_too(module: str) -> None:
    """``python -m decode_node.cli --help`` exited 0 silently, starting nothing (the module
    had no ``__main__`` guard; ``python -m decode_node`` and the console scripts did)."""
    proc = subprocess.run(
        [sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0 and "usage:" in proc.stdout, proc.stdout + proc.stderr


def test_proxy_serve_help_gives_each_default_once_and_readably() -> None:
    # `pd-proxy serve --help` said "--allowed-methods ... (vLLM's flag; default: *)
    # (default: ('*',))": the default twice, once as a Python tuple.
    from proxy.cli import build_parser as proxy_parser

    parser = proxy_parser()
    sub = parser._subparsers._group_actions[0].choices["serve"]
    for action in sub._actions:
        text = action.help or ""
        assert text.count("default:") <= 1, (action.option_strings, text)
        assert "(default: (" not in text, (action.option_strings, text)


@pytest.mark.parametrize("command", ["complete", "chat"])
def test_proxy_client_names_the_url_it_cannot_reach(command: str, capsys, monkeypatch) -> None:
    # `pd-proxy complete hi --url http://127.0.0.1:8999` (nothing listening) printed
    # "error: [Errno 111] Connection refused": which URL, and what to check, unsaid.
    import io
    import socket

    from proxy.cli import build_parser as proxy_parser
    from proxy.client import run_chat, run_complete

    with socket.socket() as s:  # a port nothing listens on once closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    argv = [command, "hi", "--url", url] if command == "complete" else [command, "--url", url]
    args = proxy_parser().parse_args(argv)
    if command == "complete":
        rc = run_complete(args, out=io.StringIO())
    else:
        rc = run_chat(args, stdin=io.StringIO("hi\n"), out=io.StringIO())
    err = capsys.readouterr().err
    assert rc == 1
    assert f"cannot reach {url}" in err and "--url" in err, err


def test_node_help_groups_read_as_prose() -> None:
    # `decode-node --help` showed "KVTransfer options: Connector settings.
    # ``kv_connector='none'`` is colocated serving." (a docstring's reST markup and class
    # name) beside "server options" and "tool calling options" in lower case.
    text = build_parser("decode").format_help()
    assert "``" not in text, text
    titles = [g.title for g in build_parser("decode")._action_groups if g.title]
    assert all(t == t.lower() or t.startswith(("KV ", "vLLM")) for t in titles), titles
    assert "KV transfer options" in titles, titles
