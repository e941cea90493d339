"""``cosine-ray distill`` end to end on a tiny target: answers, teacher pass, a domain drafter and
a feature head trained in seconds, loaded as drafters, and decoding with them lossless; resuming;
seeded reproducibility; bad input (one line, exit 2).

The tiny target is a random 2-layer model with SmolLM2's tokenizer (its vocabulary, so prompts
are text); its "domain" data is its own greedy text.
"""

from __future__ import annotations

import json

import pytest
import torch

from cosine_ray.cli import main
from cosine_ray.distill.answers import read_answers
from cosine_ray.engine.config import EngineConfig, parse_drafters
from cosine_ray.engine.local import LocalEngine
from cosine_ray.engine.request import SamplingParams

pytestmark = pytest.mark.real_model  # SmolLM2's tokenizer

PROMPTS = {"code": [f"def add_{i}(x):\n    return x + {i}" for i in range(6)],
           "math": [f"What is {i} times {i + 2}?" for i in range(6)]}


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory, real_checkpoint):
    from support.tiny_checkpoint import write_tiny_checkpoint
    return write_tiny_checkpoint(tmp_path_factory.mktemp("distill") / "tiny", num_layers=2, hidden_size=64,
                                 num_heads=4, num_kv_heads=2, intermediate_size=128, tokenizer_from=real_checkpoint,
                                 seed=3, init_std=0.2)


def _prompt_files(root):
    args = []
    for domain, prompts in PROMPTS.items():
        path = root / f"{domain}.jsonl"
        path.write_text("".join(json.dumps({"id": f"{domain}-{i}", "prompt": p}) + "\n" for i, p in enumerate(prompts)))
        args += ["--prompts", f"{domain}={path}"]
    return args


def _distill(target, root, *extra):
    return main(["distill", "--model", str(target.path), "--domains", "code,math", *_prompt_files(root),
                 "--split", "all", "--out", str(root / "out"), "--work-dir", str(root / "work"), "--max-tokens", "12",
                 "--batch-size", "6", "--vocab-size", "256", "--head-vocab-size", "256", "--epochs", "2",
                 "--head-epochs", "2", "--top-k", "8", "--threads", "1", "--no-progress", *extra])


@pytest.fixture(scope="module")
def distilled(tiny_target, tmp_path_factory):
    root = tmp_path_factory.mktemp("distilled")
    assert _distill(tiny_target, root) == 0
    return root


def test_outputs_are_hf_checkpoints_with_metadata(distilled, tiny_target):
    from cosine_ray.models.loader import resolve_checkpoint
    for domain in PROMPTS:
        folder = distilled / "out" / domain
        meta = json.loads((folder / "cosine_ray_drafter.json").read_text())
        assert meta["kind"] == "domain" and meta["domain"] == domain and meta["target"] == tiny_target.name
        assert meta["data"]["answers"] > 0 and len(meta["vocabulary"]) <= 256
        ckpt = resolve_checkpoint(folder)  # a plain HF Llama directory
        assert ckpt.config.vocab_size == len(meta["vocabulary"]) + 1 and ckpt.config.num_layers == 2
    head = json.loads((distilled / "out" / "head" / "cosine_ray_drafter.json").read_text())
    assert head["kind"] == "head" and head["target_vocab_size"] == tiny_target.config.vocab_size
    report = json.loads((distilled / "out" / "distill.json").read_text())
    assert {"answers", "teacher", "train:code", "train:math", "train:head"} <= set(report["seconds"])
    records = read_answers(distilled / "work" / "answers.jsonl")
    assert sorted(r.domain for r in records) == ["code"] * 6 + ["math"] * 6


def test_decoding_with_the_distilled_drafters_is_lossless(distilled, tiny_target):
    from support.hf_reference import hf_greedy
    out = distilled / "out"
    prompts = [p for ps in PROMPTS.values() for p in ps][:4] + ["an unseen prompt"]
    results = {}
    for drafters in ("none", f"ngram,head:{out / 'head'},distilled:{out / 'code'},distilled:{out / 'math'}",
                     f"model:{out / 'code'}", f"head:{out / 'head'}"):
        engine = LocalEngine(EngineConfig(model=str(tiny_target.path), drafters=parse_drafters(drafters)))
        ids = [engine.encode(p) for p in prompts]
        outs = engine.generate(ids, SamplingParams(max_tokens=16))
        results[drafters] = [o.new_token_ids for o in outs]
        if drafters != "none":
            assert sum(o.stats.num_draft_tokens for o in outs) > 0, drafters  # the drafters did draft
    assert all(r == results["none"] for r in results.values())
    hf = tiny_target.load_hf_model()
    assert results["none"] == [hf_greedy(hf, i, 16) for i in ids]


def test_sampled_decoding_with_the_head_is_reproducible(distilled, tiny_target):
    out = distilled / "out"
    texts = []
    for drafters in ("none", f"head:{out / 'head'},distilled:{out / 'code'}"):
        engine = LocalEngine(EngineConfig(model=str(tiny_target.path), drafters=parse_drafters(drafters)))
        outs = engine.generate([engine.encode(PROMPTS["code"][0])], SamplingParams(max_tokens=16, temperature=0.9,
                                                                                    seed=11))
        texts.append(outs[0].new_token_ids)
    assert texts[0] == texts[1]


def test_resumes_from_a_partial_answers_file_and_is_seeded(distilled, tiny_target, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    lines = (distilled / "work" / "answers.jsonl").read_text().splitlines()
    (work / "answers.jsonl").write_text("\n".join(lines[:3]) + "\n" + lines[3][:20])  # a run killed mid-line
    assert _distill(tiny_target, tmp_path) == 0
    again = {r.key: r for r in read_answers(work / "answers.jsonl")}
    first = {r.key: r for r in read_answers(distilled / "work" / "answers.jsonl")}
    assert again == first  # greedy answers: the same whichever run wrote them
    from safetensors.torch import load_file
    for part in ("code/model.safetensors", "head/head.safetensors"):
        a, b = load_file(str(distilled / "out" / part)), load_file(str(tmp_path / "out" / part))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_shared_start_trains_on_every_domain_first(distilled, tiny_target, tmp_path):
    """``--shared-epochs``: one drafter over both domains' answers, then each domain drafter
    starts from its layers; the answers and teacher shards of an earlier run are reused."""
    import shutil

    from safetensors.torch import load_file

    from cosine_ray.distill.dataset import frequent_vocabulary, load_sequences
    from cosine_ray.distill.domain import DomainTrainConfig, _student, shared_start
    shutil.copytree(distilled / "work", tmp_path / "work")
    assert _distill(tiny_target, tmp_path, "--no-head", "--shared-epochs", "1") == 0
    report = json.loads((tmp_path / "out" / "distill.json").read_text())
    assert len(report["shared_start"]["epochs"]) == 1 and "train:shared" in report["seconds"]
    for domain in PROMPTS:  # other starting layers, other weights
        a, b = load_file(str(distilled / "out" / domain / "model.safetensors")), \
            load_file(str(tmp_path / "out" / domain / "model.safetensors"))
        assert not torch.equal(a["model.layers.0.self_attn.q_proj.weight"], b["model.layers.0.self_attn.q_proj.weight"])
    # the state a shared start hands on rebuilds the trained student's layers and norm exactly
    config = DomainTrainConfig(vocab_size=64, init_layers=(0, -1))
    state = tiny_target.load_state_dict()
    vocab = frequent_vocabulary(load_sequences(tmp_path / "work" / "teacher"), 64)
    trained, _ = _student(tiny_target.config, state, vocab, config)
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(1.0)
    rebuilt, _ = _student(tiny_target.config, shared_start(tiny_target.config, state, trained, config), vocab, config)
    mine, theirs = rebuilt.state_dict(), trained.state_dict()
    for key in mine:
        if key.startswith("model.layers.") or key == "model.norm.weight":
            assert torch.equal(mine[key], theirs[key]), key


def test_bad_input_is_one_line_and_exit_2(tiny_target, tmp_path, capsys):
    from support.tiny_checkpoint import write_tiny_checkpoint
    assert main(["distill", "--model", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("cosine-ray: error:") and "missing" in err and len(err.splitlines()) == 1
    other = write_tiny_checkpoint(tmp_path / "other", num_layers=2, vocab_size=300, seed=1)  # no tokenizer, 300 ids
    assert main(["distill", "--model", str(tiny_target.path), "--init", str(other.path), "--domains", "code",
                 "--out", str(tmp_path / "o"), "--work-dir", str(tmp_path / "w")]) == 2
    err = capsys.readouterr().err.strip()
    assert "tokenizer" in err and len(err.splitlines()) == 1
    assert main(["distill", "--model", str(tiny_target.path), "--domains", "poetry"]) == 2
    assert "--prompts poetry=FILE" in capsys.readouterr().err
    assert main(["distill", "--model", str(tiny_target.path), "--layers", "0,9"]) == 2
    assert "outside" in capsys.readouterr().err
    assert main(["distill", "--model", str(tiny_target.path), "--shared-epochs", "1", "--init", str(other.path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "--shared-epochs" in err and len(err.splitlines()) == 1
    assert main(["distill", "--model", str(tiny_target.path), "--batch-tokens", "0"]) == 2
    assert "--batch-tokens" in capsys.readouterr().err


def test_a_drafter_for_another_target_is_refused(distilled, tmp_path):
    from support.tiny_checkpoint import write_tiny_checkpoint
    other = write_tiny_checkpoint(tmp_path / "other", num_layers=2, vocab_size=300, seed=1)
    for drafters in (f"distilled:{distilled / 'out' / 'code'}", f"head:{distilled / 'out' / 'head'}"):
        with pytest.raises(ValueError, match="tokenizer"):
            LocalEngine(EngineConfig(model=str(other.path), drafters=parse_drafters(drafters)))


def test_the_head_drafts_after_a_prefix_cache_hit(distilled, tiny_target):
    """A prompt prefix read from the prefix cache was never computed, so the last stage has no
    features for it: the head drafts from the rows after it instead of not at all."""
    engine = LocalEngine(EngineConfig(model=str(tiny_target.path), drafters=parse_drafters(f"head:{distilled / 'out' / 'head'}")))
    prompt = engine.encode(" ".join(PROMPTS["code"]))
    first, again = (engine.generate([prompt], SamplingParams(max_tokens=16))[0] for _ in range(2))
    assert again.stats.num_cached_tokens >= 16 and first.stats.num_cached_tokens == 0
    assert again.new_token_ids == first.new_token_ids
    assert again.stats.num_draft_tokens > 0
