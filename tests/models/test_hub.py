"""Hugging Face Hub ids through the real ``huggingface_hub``, offline (``HF_HUB_OFFLINE=1``), from
a cache laid out as huggingface_hub lays out what it downloads (``support.hub_cache``): the
repository resolves (a branch, a tag, a commit), a separate tokenizer comes from another
repository, and every failure is one line: not cached, a revision not cached, an architecture we
do not run, a revision for a model that has none. ``python -m cosine_ray.models.loader`` finds
the cache through ``HF_HOME`` in a process of its own. The embedded model laid out as
``HuggingFaceTB/SmolLM2-135M-Instruct`` decodes as the transformers reference (real model)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cosine_ray.models.hub import parse_hub_id
from cosine_ray.models.loader import ModelLoadError, cached_checkpoint, resolve_checkpoint
from support.hub_cache import SMOL_FILES, SMOL_REPO, commit_id, repo_dir, write_checkpoint_cache, write_hub_cache
from support.tiny_checkpoint import write_tiny_checkpoint

REPO = "cosine-test/tiny-llama"
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture
def hub(tmp_path, tiny_checkpoint, offline) -> Path:
    """A Hub cache (``--download-dir``) holding the tiny checkpoint as ``REPO`` at main and v1."""
    cache = tmp_path / "hub"
    write_checkpoint_cache(cache, REPO, tiny_checkpoint.path, refs=("main", "v1"))
    return cache


def one_line(exc: pytest.ExceptionInfo) -> str:
    message = str(exc.value)
    assert message and "\n" not in message, message
    return message


def test_hub_ids_are_told_from_paths():
    assert parse_hub_id("HuggingFaceTB/SmolLM2-135M-Instruct") == ("HuggingFaceTB/SmolLM2-135M-Instruct", None)
    assert parse_hub_id("org/name-GGUF/sub/model.Q4_0.gguf") == ("org/name-GGUF", "sub/model.Q4_0.gguf")
    for not_an_id in ("./org/name", "/abs/path", "~/models/x", "a/b/c", "name", "org//name", "org/na me"):
        assert parse_hub_id(not_an_id) is None, not_an_id


def test_a_cached_repository_resolves_to_its_snapshot(hub, tiny_checkpoint):
    ck = resolve_checkpoint(REPO, download_dir=hub)
    snapshot = repo_dir(hub, REPO) / "snapshots" / commit_id(REPO)
    assert ck.name == REPO and ck.path == snapshot
    assert ck.config == tiny_checkpoint.config
    assert (ck.path / "model.safetensors").read_bytes() == (tiny_checkpoint.path / "model.safetensors").read_bytes()
    # the same through a tag and through the commit itself
    assert resolve_checkpoint(REPO, revision="v1", download_dir=hub).path == snapshot
    assert resolve_checkpoint(REPO, revision=commit_id(REPO), download_dir=hub).path == snapshot


def test_each_revision_is_its_own_snapshot(hub, tmp_path, tiny_checkpoint_variants):
    other = tiny_checkpoint_variants["qwen2"]
    write_checkpoint_cache(hub, REPO, other.path, commit=commit_id("v2"), refs=("v2",))
    assert resolve_checkpoint(REPO, revision="v2", download_dir=hub).config.model_type == "qwen2"
    assert resolve_checkpoint(REPO, download_dir=hub).config.model_type == "llama"  # main unchanged


def test_not_cached_offline_is_one_line(hub):
    with pytest.raises(ModelLoadError) as exc:
        resolve_checkpoint("cosine-test/absent", download_dir=hub)
    message = one_line(exc)
    assert "'cosine-test/absent' is not in the Hugging Face cache" in message and "HF_HUB_OFFLINE=1" in message


def test_a_revision_not_in_the_cache_is_one_line(hub):
    with pytest.raises(ModelLoadError) as exc:
        resolve_checkpoint(REPO, revision="v9", download_dir=hub)
    message = one_line(exc)
    assert f"'{REPO}' at revision 'v9' is not in the Hugging Face cache" in message and str(hub) in message


def test_an_unsupported_architecture_is_one_line_before_any_weights(tmp_path, offline):
    """Only config.json is cached: the refusal comes from it, the weights are never asked for."""
    cache = tmp_path / "hub"
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "gpt2", "vocab_size": 100, "hidden_size": 8, "intermediate_size": 8,
                                  "num_hidden_layers": 1, "num_attention_heads": 2}))
    write_hub_cache(cache, "cosine-test/gpt2", {"config.json": config})
    with pytest.raises(ModelLoadError) as exc:
        resolve_checkpoint("cosine-test/gpt2", download_dir=cache)
    message = one_line(exc)
    assert message.startswith("model 'cosine-test/gpt2': model_type 'gpt2' is not supported") and "llama" in message


def test_a_cached_repository_without_weights_is_one_line(tmp_path, tiny_checkpoint, offline):
    cache = tmp_path / "hub"
    write_checkpoint_cache(cache, REPO, tiny_checkpoint.path, names=("config.json",))
    with pytest.raises(ModelLoadError) as exc:
        resolve_checkpoint(REPO, download_dir=cache)
    assert one_line(exc) == f"model '{REPO}' has config.json but no weights (model.safetensors or sharded *.safetensors)"


def test_a_gguf_file_not_cached_is_one_line_naming_it(hub):
    with pytest.raises(ModelLoadError) as exc:
        resolve_checkpoint(f"{REPO}/model.Q4_0.gguf", download_dir=hub)
    assert f"'{REPO}/model.Q4_0.gguf' is not in the Hugging Face cache" in one_line(exc)


@pytest.mark.parametrize("kind, status, expected", [
    ("GatedRepoError", 403, "model 'org/name' at revision 'v9' is gated on the Hugging Face Hub: accept its terms at "
                            "https://huggingface.co/org/name and set HF_TOKEN"),
    ("RepositoryNotFoundError", 404, "model 'org/name': no such repository on the Hugging Face Hub, or a private "
                                     "one this HF_TOKEN cannot read"),
    ("RevisionNotFoundError", 404, "model 'org/name' has no revision 'v9' on the Hugging Face Hub"),
    ("HfHubHTTPError", 401, "model 'org/name' at revision 'v9': the Hugging Face Hub refused access (401); set HF_TOKEN"),
])
def test_the_hubs_refusals_are_one_line_each(kind, status, expected):
    """What huggingface_hub raises when the Hub answers (its own exception types, with the
    Hub's answer), as the one line each becomes."""
    import httpx2
    from huggingface_hub import errors

    from cosine_ray.models.hub import _hub_errors

    answer = httpx2.Response(status, request=httpx2.Request("GET", "https://huggingface.co/api/models/org/name"))
    with pytest.raises(ModelLoadError) as exc, _hub_errors("org/name", "v9", None):
        raise getattr(errors, kind)("the Hub's own words\nover two lines", response=answer)
    assert one_line(exc).startswith(expected)


def test_a_revision_for_a_model_that_has_none_is_refused(tiny_checkpoint):
    with pytest.raises(ModelLoadError) as exc:
        resolve_checkpoint(tiny_checkpoint.path, revision="v1")
    assert "is not a Hugging Face Hub id, so it has no revisions" in one_line(exc)


def test_the_tokenizer_comes_from_another_repository(tmp_path, tiny_checkpoint, offline):
    """A model without tokenizer files takes another repository's (its tokenizer files alone)."""
    from support.byte_tokenizer import save_byte_tokenizer

    cache = tmp_path / "hub"
    write_checkpoint_cache(cache, REPO, tiny_checkpoint.path)
    tokenizer_dir = tmp_path / "tok"
    tokenizer_dir.mkdir()
    save_byte_tokenizer(tokenizer_dir)
    write_checkpoint_cache(cache, "cosine-test/bytes", tokenizer_dir)
    plain = resolve_checkpoint(REPO, download_dir=cache)
    assert not plain.has_tokenizer
    ck = resolve_checkpoint(REPO, tokenizer="cosine-test/bytes", download_dir=cache)
    assert ck.path == plain.path and ck.tokenizer_dir == repo_dir(cache, "cosine-test/bytes") / "snapshots" / \
        commit_id("cosine-test/bytes")
    assert ck.load_tokenizer()("hi")["input_ids"]
    assert resolve_checkpoint(tiny_checkpoint.path, tokenizer=str(tokenizer_dir)).tokenizer_dir == tokenizer_dir
    with pytest.raises(ModelLoadError) as exc:
        resolve_checkpoint(REPO, tokenizer="cosine-test/nowhere", download_dir=cache)
    assert "'cosine-test/nowhere' is not in the Hugging Face cache" in one_line(exc)


def test_the_python_api_takes_a_hub_id_and_says_a_failure_in_one_line(hub, tiny_checkpoint):
    from cosine_ray import LLM, SamplingParams

    llm = LLM(REPO, download_dir=str(hub), drafters="none")
    plain = LLM(str(tiny_checkpoint.path), drafters="none")
    params = SamplingParams(max_tokens=8, temperature=0)
    assert llm.generate([[3, 4, 5]], params, use_tqdm=False)[0].outputs[0].token_ids == \
        plain.generate([[3, 4, 5]], params, use_tqdm=False)[0].outputs[0].token_ids
    with pytest.raises(ValueError) as exc:
        LLM("cosine-test/absent", download_dir=str(hub))
    assert "'cosine-test/absent' is not in the Hugging Face cache" in one_line(exc)


def test_only_what_needs_no_fetch_resolves_without_huggingface_hub(hub, tiny_checkpoint):
    assert cached_checkpoint(tiny_checkpoint.path).path == tiny_checkpoint.path
    assert cached_checkpoint(REPO, download_dir=hub) is None  # the cache of a Hub id is huggingface_hub's to read


def run_loader(*argv: str, env: dict[str, str]) -> tuple[int, dict]:
    """The loader in a child whose environment is ours with ``env`` over it, without any other
    setting of huggingface_hub's cache."""
    base = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME")}
    done = subprocess.run([sys.executable, "-m", "cosine_ray.models.loader", *argv], capture_output=True, text=True,
                          timeout=300, env={**base, "PYTHONPATH": os.pathsep.join(map(str, (ROOT, *sys.path))), **env})
    return done.returncode, json.loads(done.stdout.strip().splitlines()[-1])


def test_hf_home_is_the_cache_of_a_process_of_its_own(tmp_path, tiny_checkpoint):
    """``python -m cosine_ray.models.loader`` (what ``cosine-ray serve`` runs) finds the model
    where ``HF_HOME`` says, huggingface_hub's own reading of it, and says what fails in one line."""
    write_checkpoint_cache(tmp_path / "home" / "hub", REPO, tiny_checkpoint.path)
    env = {"HF_HOME": str(tmp_path / "home"), "HF_HUB_OFFLINE": "1"}
    code, answer = run_loader(REPO, env=env)
    assert code == 0, answer
    assert answer["name"] == REPO and Path(answer["path"]).parent.parent == repo_dir(tmp_path / "home" / "hub", REPO)
    code, answer = run_loader("cosine-test/absent", env=env)
    assert code == 2 and "not in the Hugging Face cache" in answer["error"] and "\n" not in answer["error"]


@pytest.mark.real_model
def test_the_embedded_model_as_its_hub_repository_decodes_as_transformers(tmp_path, real_checkpoint, real_hf_model,
                                                                        offline):
    """SmolLM2-135M-Instruct from a Hub cache (the embedded model's files under its real id)
    through the whole engine: greedy tokens equal transformers' on the embedded checkpoint."""
    from cosine_ray.engine.config import EngineConfig
    from cosine_ray.engine.local import LocalEngine
    from cosine_ray.engine.request import SamplingParams
    from support.hf_reference import hf_greedy

    cache = tmp_path / "hub"
    write_checkpoint_cache(cache, SMOL_REPO, real_checkpoint.path, names=SMOL_FILES)
    engine = LocalEngine(EngineConfig(model=SMOL_REPO, download_dir=str(cache)).replace(num_speculative_tokens=4))
    assert engine.checkpoint.name == SMOL_REPO and engine.checkpoint.config == real_checkpoint.config
    prompt = engine.encode("Write a Python function that reverses a string.")
    (out,) = engine.generate([prompt], SamplingParams(max_tokens=24, temperature=0.0))
    assert out.new_token_ids == hf_greedy(real_hf_model, prompt, 24)
