"""Frozen, validated configuration for a pdserve engine and node.

Each dataclass validates itself in ``__post_init__`` and raises ``ConfigError`` with a
message that names the flag to fix. CLI flags are derived from these fields
(see ``engine.server.cli_args``): a field ``max_num_seqs`` becomes ``--max-num-seqs``.
"""

from __future__ import annotations

import dataclasses
import os
import re
import uuid
from dataclasses import dataclass, field
from typing import Literal


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the flag to fix."""


def flag_name(name: str) -> str:
    """The command-line flag of a config field: ``max_num_seqs`` -> ``--max-num-seqs``."""
    return "--" + name.replace("_", "-")


def require(cond: bool, name: str, msg: str, error: type[ValueError] = ConfigError) -> None:
    """Raise ``error("--flag: msg")`` unless ``cond`` (engine and proxy configs)."""
    if not cond:
        raise error(f"{flag_name(name)}: {msg}")


TINY_MODEL = "tiny"
_REPO_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


def is_repo_id(model: str) -> bool:
    """The shape of a Hugging Face repo id, ``org/name`` (``engine.model.hub`` resolves it)."""
    return bool(_REPO_ID_RE.match(model)) and ".." not in model and not model.endswith(".")


# The most log-probability entries one request's answer may hold, all its choices together
# (``--max-logprob-entries``, nodes and proxy): an answer is held whole in memory (~300
# bytes an entry while it is built and rendered), so 10M entries is ~3 GB. A request of one
# choice is never refused by it (its own bound is the context x (``--max-logprobs`` + 1)).
DEFAULT_MAX_LOGPROB_ENTRIES = 10_000_000


@dataclass(frozen=True)
class ModelConfig:
    model: str = field(
        default="tiny",
        metadata={
            "help": "HF checkpoint directory, Hugging Face repo id (org/name, downloaded "
            "into the HF cache) or 'tiny'"
        },
    )
    revision: str | None = field(
        default=None,
        metadata={"help": "branch, tag or commit of a repo-id --model (default: main)"},
    )
    download_dir: str | None = field(
        default=None,
        metadata={
            "help": "Hugging Face cache directory for a repo-id --model "
            "(default: $HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub)"
        },
    )
    served_model_name: tuple[str, ...] | None = field(
        default=None,
        metadata={
            "help": "name(s) clients use in 'model' (vLLM's: several names are each accepted; "
            "answers and the log give the first) (default: --model)"
        },
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = field(
        default="auto",
        metadata={
            "help": "weight and KV cache dtype; auto: the checkpoint's, bfloat16 instead of "
            "float32 on cuda, float32 on cpu (vLLM's half and float: float16, float32)",
            "value_aliases": {"half": "float16", "float": "float32"},
        },
    )
    max_model_len: int | None = field(
        default=None,
        metadata={
            "help": "context length (default: model's maximum); vLLM's sizes: 32k = 32000, "
            "32K = 32768",
            "human_readable": True,
        },
    )
    seed: int = field(default=0, metadata={"help": "seed for the 'tiny' model's weights"})
    attention_backend: Literal["auto", "reference", "triton"] = field(
        default="auto",
        metadata={"help": "attention kernels: auto (triton on cuda, reference on cpu)"},
    )
    enforce_eager: bool = field(
        default=False, metadata={"help": "never use CUDA graphs (decode steps run eagerly)"}
    )
    max_logprobs: int = field(
        default=20,
        metadata={
            "help": "the most log probabilities per token a request may ask for -- "
            "logprobs, top_logprobs, prompt_logprobs -- (vLLM's flag; more is a 400 naming "
            "it); -1: the vocabulary size"
        },
    )
    max_logprob_entries: int = field(
        default=DEFAULT_MAX_LOGPROB_ENTRIES,
        metadata={
            "help": "the most log-probability entries the answer of a request with several "
            "choices (n, a batch of prompts) may hold, all choices together: per choice, each "
            "prompt token's prompt_logprobs + 1 and each output token's (up to max_tokens; "
            "with echo, each prompt token's too) logprobs + 1; more is a 400. Bounds the "
            "memory one answer takes (~300 bytes an entry)"
        },
    )
    generation_config: str = field(
        default="auto",
        metadata={
            "help": "vLLM's flag: auto reads the checkpoint's generation_config.json -- "
            "temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens -- as "
            "the defaults of requests that do not set them; vllm ignores it; a directory: "
            "that directory's generation_config.json"
        },
    )
    chat_template: str | None = field(
        default=None,
        repr=False,  # may be a whole template: logged by the tokenizer's loader instead
        metadata={
            "help": "Jinja chat template for chat requests, instead of the model's (vLLM's "
            "flag): a file, or the template itself (with '{', '}' or a line break; '\\n' "
            "is a line break). Give a P/D pair's nodes the same one"
        },
    )

    def __post_init__(self) -> None:
        names = self.served_model_name
        if isinstance(names, str | list):  # one name (the API's, a config file's), a list
            object.__setattr__(
                self, "served_model_name", (names,) if isinstance(names, str) else tuple(names)
            )
        require(
            self.served_model_name is None
            or (bool(self.served_model_name) and all(n.strip() for n in self.served_model_name)),
            "served_model_name",
            "every name must be a non-empty string",
        )
        require(
            self.max_logprobs >= -1,
            "max_logprobs",
            f"must be >= 0, or -1 (the vocabulary size), got {self.max_logprobs}",
        )
        require(
            self.max_logprob_entries >= 1,
            "max_logprob_entries",
            f"must be >= 1, got {self.max_logprob_entries}",
        )
        require(
            self.generation_config in ("auto", "vllm") or os.path.isdir(self.generation_config),
            "generation_config",
            f"{self.generation_config!r} is neither auto, vllm nor a directory",
        )
        require(bool(self.model), "model", "must be a checkpoint directory, a repo id or 'tiny'")
        require(
            self.model == TINY_MODEL or os.path.isdir(self.model) or is_repo_id(self.model),
            "model",
            f"{self.model!r} is neither 'tiny', a checkpoint directory, "
            "nor a Hugging Face repo id (org/name)",
        )
        require(
            self.revision is None or bool(self.revision.strip()),
            "revision",
            "must not be empty",
        )
        require(
            self.max_model_len is None or self.max_model_len > 0,
            "max_model_len",
            "must be a positive number of tokens",
        )
        if self.chat_template is not None:
            from engine.tokenizer import ByteTokenizer, load_chat_template

            try:  # read and compiled now: a bad one exits 2 before the model loads
                ByteTokenizer().set_chat_template(load_chat_template(self.chat_template))
            except ValueError as e:
                require(False, "chat_template", str(e))

    @property
    def name(self) -> str:
        """The served name answers carry (the first of --served-model-name)."""
        return self.served_names[0]

    @property
    def served_names(self) -> tuple[str, ...]:
        """Every name a request's 'model' may give (--served-model-name, else --model)."""
        return self.served_model_name or (self.model,)


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = field(default=16, metadata={"help": "tokens per KV block"})
    num_blocks: int | None = field(
        default=None, metadata={"help": "KV blocks per rank (overrides --kv-memory-fraction)"}
    )
    kv_memory_fraction: float = field(
        default=0.05, metadata={"help": "cpu: fraction of host memory for the KV cache"}
    )
    gpu_memory_utilization: float = field(
        default=0.9,
        metadata={
            "help": "cuda: fraction of GPU memory this node may use (weights, activations, "
            "KV cache); the KV cache gets what the profiled model leaves"
        },
    )
    enable_prefix_caching: bool = field(default=True, metadata={"help": "reuse cached prefixes"})

    def __post_init__(self) -> None:
        require(
            self.block_size > 0 and (self.block_size & (self.block_size - 1)) == 0,
            "block_size",
            f"must be a power of two, got {self.block_size}",
        )
        require(
            self.num_blocks is None or self.num_blocks >= 2,
            "num_blocks",
            "must be at least 2",
        )
        require(
            0.0 < self.kv_memory_fraction <= 0.95,
            "kv_memory_fraction",
            "must be in (0, 0.95]",
        )
        require(
            0.0 < self.gpu_memory_utilization <= 1.0,
            "gpu_memory_utilization",
            "must be in (0, 1]",
        )


@dataclass(frozen=True)
class ParallelConfig:
    tp: int = field(
        default=1,
        metadata={
            "help": "tensor-parallel size (worker processes)",
            "aliases": ("--tensor-parallel-size", "-tp"),  # vLLM's spellings
        },
    )
    device: Literal["auto", "cpu", "cuda"] = field(
        default="auto",
        metadata={
            "help": "cpu or cuda; auto: cuda where torch is a CUDA build and an NVIDIA GPU "
            "is visible, else cpu"
        },
    )
    worker_threads: int = field(
        default=1, metadata={"help": "torch intra-op threads per CPU worker"}
    )
    step_timeout: float = field(
        default=600.0,
        metadata={"help": "seconds a step may take before its workers count as hung"},
    )
    distributed_executor_backend: Literal["auto", "mp", "uni"] = field(
        default="auto",
        metadata={
            "help": "mp: one worker process per TP rank; uni (vLLM's, TP 1 only): the rank "
            "runs in the engine's process (no worker process, no per-step pipe); auto: uni "
            "for the offline LLM at TP 1, mp otherwise (a node's engine loop shares its "
            "process with the HTTP server)"
        },
    )

    def __post_init__(self) -> None:
        if self.device == "auto":  # the config holds the device it resolved to
            from engine.device import resolve_device

            object.__setattr__(self, "device", resolve_device(self.device))
        require(self.tp >= 1, "tp", "must be >= 1")
        require(self.step_timeout > 0, "step_timeout", "must be > 0 seconds")
        require(self.worker_threads >= 1, "worker_threads", "must be >= 1")
        require(
            self.distributed_executor_backend != "uni" or self.tp == 1,
            "distributed_executor_backend",
            f"uni runs one rank in the engine's process; --tp {self.tp} needs mp (or auto)",
        )


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = field(default=64, metadata={"help": "max running requests per step"})
    max_num_batched_tokens: int = field(
        default=2048,
        metadata={
            "help": "token budget per step (chunked prefill); 8k, 8K",
            "human_readable": True,
        },
    )
    async_scheduling: bool | None = field(
        default=None,
        metadata={
            "help": "schedule step N+1 while step N runs (vLLM's flag): the host's "
            "scheduling and output work overlaps the forward; the workers fill in the "
            "tokens step N sampled. On by default, as vLLM's (every pdserve feature "
            "supports it: P/D roles, TP, both executors, structured outputs, penalties, "
            "the pipelined push); --no-async-scheduling: each step scheduled once the "
            "one before it ended"
        },
    )
    scheduling_policy: Literal["fcfs", "priority"] = field(
        default="fcfs",
        metadata={
            "help": "fcfs: requests start in arrival order; priority (vLLM's): by each "
            "request's 'priority' (lower first, then arrival), and when KV blocks run out "
            "the running request with the largest priority is preempted"
        },
    )
    max_queued_requests: int = field(
        default=256,
        metadata={
            "help": "generation requests a node holds beyond --max-num-seqs (waiting to run, "
            "being tokenized, waiting for their KV); past max-num-seqs + this, new ones get "
            "429 with Retry-After"
        },
    )

    def __post_init__(self) -> None:
        if self.async_scheduling is None:  # unset: on, vLLM's default (the config holds it)
            object.__setattr__(self, "async_scheduling", True)
        require(self.max_num_seqs >= 1, "max_num_seqs", "must be >= 1")
        require(self.max_num_batched_tokens >= 1, "max_num_batched_tokens", "must be >= 1")
        require(
            self.max_queued_requests >= 0,
            "max_queued_requests",
            f"must be >= 0 (0: no queue, only --max-num-seqs requests), "
            f"got {self.max_queued_requests}",
        )

    @property
    def max_admitted_requests(self) -> int:
        """Generation requests a node holds at once; the next one gets 429."""
        return self.max_num_seqs + self.max_queued_requests


@dataclass(frozen=True)
class KVTransferConfig:
    """P/D connector settings; --kv-connector none (the default) serves each request on this node alone (colocated)."""

    kv_connector: Literal["none", "nixl"] = field(
        default="none", metadata={"help": "KV connector: none (colocated) or nixl"}
    )
    kv_role: Literal["both", "producer", "consumer"] = field(
        default="both", metadata={"help": "producer (prefill), consumer (decode) or both"}
    )
    kv_transport: Literal["nixl", "ucxx"] = field(
        default="nixl",
        metadata={
            "help": "library moving KV blocks between P and D ranks: nixl (NIXL WRITE over "
            "UCX) or ucxx (UCXX tagged messages, for deployments without NIXL; needs "
            "pip install -e '.[ucxx]'); P and D must use the same one"
        },
    )
    side_channel_host: str = field(
        default="127.0.0.1", metadata={"help": "address the side channel binds/advertises"}
    )
    side_channel_port: int = field(default=0, metadata={"help": "side-channel port (0 = free)"})
    kv_transfer_timeout: float = field(
        default=30.0, metadata={"help": "seconds any KV-transfer wait may last"}
    )
    kv_failure_policy: Literal["recompute", "fail"] = field(
        default="recompute", metadata={"help": "on transfer failure: recompute or fail"}
    )
    peer_ping_interval: float = field(
        default=1.0,
        metadata={"help": "seconds between liveness pings to prefill peers (0 = off)"},
    )
    engine_id: str = field(
        default_factory=lambda: uuid.uuid4().hex[:12],
        metadata={"help": "engine id advertised to peers (default: random)"},
    )
    kv_checksum: Literal["off", "sampled", "full"] = field(
        default="off",
        metadata={
            "help": "checksum pushed KV blocks on P and verify them on D before decoding "
            "(a mismatch is a failed transfer: recompute or fail by --kv-failure-policy); "
            "sampled checks up to 4 blocks per transfer, full every block; P and D must agree"
        },
    )
    kv_layer_group_size: int = field(
        default=0,
        metadata={
            "help": "pipelined push: a prefill node whose decode node already reserved "
            "blocks pushes the prompt's KV this many layers at a time while its last "
            "prefill step still computes the later layers, so only the last group's "
            "transfer adds to TTFT (0: push whole blocks after the prefill step). "
            "Needs --kv-transport nixl; set on prefill nodes"
        },
    )
    kv_progress_thread: Literal["auto", "on", "off"] = field(
        default="auto",
        metadata={
            "help": "NIXL's UCX progress thread in each worker: it moves bytes in the "
            "background (TCP across hosts, a WRITE during a forward) but busy-polls a "
            "core per worker even when idle; off: UCX progresses when the worker polls "
            "its transfers (every 0.5 ms while any is open, and in every step). auto: "
            "off on CPU (same-host copies are synchronous and the cores compute), on "
            "with --device cuda"
        },
    )
    kv_reserve_first: bool = field(
        default=True,
        metadata={
            "help": "a prefill node computes a prefill leg only once its decode node "
            "reserved the blocks (as SGLang and Dynamo order it; other requests pass the "
            "waiting leg; no reservation within --kv-transfer-timeout fails it): it never "
            "holds KV no decode node has room for, so a full decode node and a full "
            "prefill node cannot wait on each other, and every push can be pipelined. "
            "A prefill leg without a transfer_id (a client that sends the decode leg "
            "after the prefill leg's answer) is computed at once. --no-kv-reserve-first: "
            "every leg at once, overlapping D's admission (lower TTFT by that much)"
        },
    )
    kv_pipeline_wait_ms: float = field(
        default=20.0,
        metadata={
            "help": "with --kv-layer-group-size and --no-kv-reserve-first: how long a "
            "prefill node holds a new prefill leg for its decode node's reservation, so "
            "that it knows where to write before the prefill runs and can pipeline the "
            "push (0: never wait)"
        },
    )
    kv_allowed_peers: str = field(
        default="loopback",
        metadata={
            "help": "side channels this node may talk to: the prefill nodes a decode leg's "
            "kv_transfer_params.remote_side_channel may name, the decode nodes a prefill "
            "node accepts handshakes from. Comma-separated HOST, HOST:PORT, CIDR, "
            "'loopback' or '*' (any: only where every caller is trusted)"
        },
    )
    kv_secret: str = field(
        default_factory=lambda: os.environ.get("PDSERVE_KV_SECRET", ""),
        repr=False,  # never logged
        metadata={
            "help": "shared secret signing every side-channel message (HMAC-SHA256; "
            "replays refused); all prefill and decode nodes of a deployment need the same "
            "one (default: $PDSERVE_KV_SECRET -- prefer it to the flag, which `ps` shows; "
            "unset: unsigned, for one trusted box)"
        },
    )

    def __post_init__(self) -> None:
        require(0 <= self.side_channel_port < 65536, "side_channel_port", "must be in [0, 65535]")
        require(self.kv_transfer_timeout > 0, "kv_transfer_timeout", "must be > 0 seconds")
        require(self.peer_ping_interval >= 0, "peer_ping_interval", "must be >= 0 seconds")
        require(self.kv_layer_group_size >= 0, "kv_layer_group_size", "must be >= 0 (0: off)")
        require(0 <= self.kv_pipeline_wait_ms <= 10_000, "kv_pipeline_wait_ms",
                "must be in [0, 10000] ms")  # fmt: skip
        require(
            self.kv_layer_group_size == 0 or self.kv_transport == "nixl",
            "kv_layer_group_size",
            "the pipelined push needs --kv-transport nixl (set --kv-layer-group-size 0)",
        )
        if self.kv_connector == "nixl" and self.kv_transport == "ucxx":
            import importlib.util

            require(
                importlib.util.find_spec("ucxx") is not None,
                "kv_transport",
                "ucxx is not installed: pip install -e '.[ucxx]' (or use --kv-transport nixl)",
            )
        from kvconnector.nixl.peers import PeerAllowlist

        try:
            PeerAllowlist.parse(self.kv_allowed_peers)
        except ValueError as e:
            require(False, "kv_allowed_peers", str(e))


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    kv_transfer: KVTransferConfig = field(default_factory=KVTransferConfig)

    def replace(self, **sections: object) -> EngineConfig:
        return dataclasses.replace(self, **sections)  # type: ignore[arg-type]
