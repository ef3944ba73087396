"""Models by name: ``--model ORG/NAME`` through a (fake, local) Hugging Face cache."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import pytest
from hf_models import make_hf_model, save_hf_model

from engine.config import ConfigError, EngineConfig, ModelConfig, is_repo_id
from engine.model.hub import resolve_model, resolve_model_config
from kvconnector.nixl.messages import model_fingerprint

pytest.importorskip("transformers")

REPO = "pdserve-test/tiny-llama"
REV_MAIN = "a" * 40
REV_V1 = "b" * 40


def write_tokenizer(path: Path) -> None:
    """A small word-level BPE tokenizer whose ids fit the 256-token test model."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.BPEDecoder()
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<s>", "</s>"])
    tok.train_from_iterator(
        ["hello world the quick brown fox jumps over the lazy dog"] * 5, trainer
    )
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>"})
    )


def make_hf_cache(root: Path, repo: str = REPO) -> Path:
    """``root`` laid out as a Hugging Face hub cache holding ``repo`` at two revisions:
    ``refs/main`` -> REV_MAIN and ``refs/v1`` -> REV_V1 (same files)."""
    repo_dir = root / ("models--" + repo.replace("/", "--"))
    first = repo_dir / "snapshots" / REV_MAIN
    first.mkdir(parents=True)
    save_hf_model(make_hf_model("llama"), first)
    write_tokenizer(first)
    shutil.copytree(first, repo_dir / "snapshots" / REV_V1)
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(REV_MAIN)
    (repo_dir / "refs" / "v1").write_text(REV_V1)
    return root


@pytest.fixture(scope="module")
def hf_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_hf_cache(tmp_path_factory.mktemp("hf_cache"))


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch, hf_cache: Path) -> Path:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(hf_cache))
    monkeypatch.delenv("HF_HOME", raising=False)
    return hf_cache


def _snapshot(cache: Path, rev: str) -> str:
    return str(cache / ("models--" + REPO.replace("/", "--")) / "snapshots" / rev)


def test_repo_id_shape() -> None:
    assert is_repo_id("Qwen/Qwen2.5-0.5B-Instruct") and is_repo_id("meta-llama/Llama-3.1-8B")
    for bad in ("tiny", "/abs/path", "a/b/c", "../x", "org/", "/name", "org/na me", "./x"):
        assert not is_repo_id(bad), bad


def test_model_config_accepts_repo_ids_and_names_the_flag() -> None:
    assert ModelConfig(model="Qwen/Qwen2.5-0.5B-Instruct").name == "Qwen/Qwen2.5-0.5B-Instruct"
    for bad in ("/nonexistent/dir", "a/b/c"):
        with pytest.raises(ConfigError, match="--model"):
            ModelConfig(model=bad)
    with pytest.raises(ConfigError, match="--revision"):
        ModelConfig(model="org/name", revision=" ")


def test_tiny_and_directories_pass_through(tmp_path: Path) -> None:
    assert resolve_model("tiny") == "tiny"
    assert resolve_model(str(tmp_path)) == str(tmp_path)
    cfg = EngineConfig()
    assert resolve_model_config(cfg) is cfg


def test_resolves_from_the_cache_offline(offline: Path) -> None:
    assert resolve_model(REPO) == _snapshot(offline, REV_MAIN)
    assert resolve_model(REPO, revision="v1") == _snapshot(offline, REV_V1)
    assert resolve_model(REPO, revision=REV_V1) == _snapshot(offline, REV_V1)
    cfg = resolve_model_config(EngineConfig(model=ModelConfig(model=REPO)))
    assert cfg.model.model == _snapshot(offline, REV_MAIN)
    assert cfg.model.name == REPO  # clients still ask for the repo id
    named = EngineConfig(model=ModelConfig(model=REPO, served_model_name="mine"))
    assert resolve_model_config(named).model.name == "mine"


def test_hf_home_and_download_dir(
    monkeypatch: pytest.MonkeyPatch, hf_cache: Path, tmp_path: Path
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "hub").symlink_to(hf_cache)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert resolve_model(REPO) == _snapshot(hf_cache, REV_MAIN)  # via $HF_HOME/hub
    monkeypatch.delenv("HF_HOME")
    assert resolve_model(REPO, download_dir=str(hf_cache)) == _snapshot(hf_cache, REV_MAIN)


def test_unknown_repo_offline_names_the_flag(offline: Path) -> None:
    with pytest.raises(ConfigError, match="--model: 'nobody/nothing' .*HF_HUB_OFFLINE"):
        resolve_model("nobody/nothing")
    with pytest.raises(ConfigError, match="--model"):
        resolve_model(REPO, revision="no-such-branch")


def test_fingerprint_depends_on_content_not_path(hf_cache: Path, tmp_path: Path) -> None:
    """Two nodes serving one repo from different cache directories (or a renamed local
    copy) pair; another checkpoint does not."""
    other_cache = make_hf_cache(tmp_path / "other")
    a = model_fingerprint(_snapshot(hf_cache, REV_MAIN), 0)
    b = model_fingerprint(_snapshot(other_cache, REV_MAIN), 0)
    copy = shutil.copytree(_snapshot(hf_cache, REV_MAIN), tmp_path / "my-local-copy")
    assert a == b == model_fingerprint(str(copy), 0)
    assert a.startswith("LlamaForCausalLM/")
    qwen = save_hf_model(make_hf_model("qwen2"), tmp_path / "qwen")
    assert model_fingerprint(qwen, 0) != a


# -- a node started with --model ORG/NAME ----------------------------------------------------


def test_node_serves_a_repo_id(procs, hf_cache: Path) -> None:
    env = {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(hf_cache)}
    node = procs.node("--model", REPO, "--num-blocks", "64", env=env)
    models = httpx.get(node.url + "/v1/models", timeout=10).json()
    assert models["data"][0]["id"] == REPO
    body = {"model": REPO, "prompt": "hello world", "max_tokens": 4, "temperature": 0}
    r = httpx.post(node.url + "/v1/completions", json={**body, "ignore_eos": True}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4


def test_node_unknown_repo_offline_fails_fast(procs, hf_cache: Path) -> None:
    env = {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(hf_cache)}
    node = procs.node("--model", "nobody/nothing", wait=False, env=env)
    assert node.proc.wait(60) == 2
    assert "--model: 'nobody/nothing'" in node.logs()


def test_without_a_cache_setting_messages_name_the_librarys_cache_path(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # No --download-dir, $HF_HUB_CACHE or $HF_HOME: the messages name the directory the
    # library uses, where a user can look (they said "the Hugging Face cache the default
    # Hugging Face cache").
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HF_HOME", raising=False)
    with (
        caplog.at_level("INFO", logger="engine.model.hub"),
        pytest.raises(ConfigError) as err,
    ):
        resolve_model("nobody/nothing")
    assert f"({constants.HF_HUB_CACHE})" in str(err.value)
    logged = " ".join(r.getMessage() for r in caplog.records)
    assert f"through the Hugging Face cache {constants.HF_HUB_CACHE} (offline)" in logged
    assert "default Hugging Face cache" not in logged + str(err.value)
