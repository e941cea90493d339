"""Workloads: the held-back split, exact domain mixes, seeding, multi-turn, random tokens, bad files."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from support.loadgen_fixtures import rows, write_dataset

from cosine_ray.datasets import DOMAIN_FILES, PACKAGED_PROMPT_DIR
from loadgen.workload import (WorkloadError, dataset_workload, default_dataset_dir,
                              load_rows, parse_domain_mix, random_workload, split_counts)


def rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def test_default_dataset_is_the_packaged_prompt_sets(monkeypatch, tmp_path):
    """loadgen finds cosine_ray's packaged prompt folder without importing cosine_ray (same rule)."""
    monkeypatch.delenv("COSINE_RAY_PROMPTS", raising=False)
    assert default_dataset_dir() == PACKAGED_PROMPT_DIR
    assert sorted(p.name for p in PACKAGED_PROMPT_DIR.glob("*.jsonl")) == sorted(DOMAIN_FILES.values())
    monkeypatch.setenv("COSINE_RAY_PROMPTS", str(tmp_path))
    assert default_dataset_dir() == tmp_path


def test_default_split_is_the_second_half_of_every_file():
    by_domain = load_rows(PACKAGED_PROMPT_DIR)
    assert set(by_domain) == {"code", "math", "instruction", "chat"}
    for path in sorted(PACKAGED_PROMPT_DIR.glob("*.jsonl")):
        ids = [json.loads(line)["id"] for line in path.read_text().splitlines() if line.strip()]
        second = set(ids[(len(ids) + 1) // 2:])
        domain = {"humaneval": "code", "gsm8k": "math", "alpaca": "instruction", "mtbench": "chat"}[path.stem]
        assert {r.source_id for r in by_domain[domain]} == second
    # MT-bench rows keep both turns; their domain "chat/<category>" maps to "chat"
    assert all(len(r.turns) == 2 for r in by_domain["chat"])


def test_equal_mix_is_exact_and_seeded(tmp_path):
    data = write_dataset(tmp_path, {d: rows(d, [f"{d} prompt {i}" for i in range(10)]) for d in ("a", "b", "c", "d")})
    by_domain = load_rows(data, "all")
    mix = parse_domain_mix(None, list(by_domain))
    items = dataset_workload(by_domain, 20, mix, rng(1), max_tokens=7)
    assert Counter(i.domain for i in items) == {"a": 5, "b": 5, "c": 5, "d": 5}
    assert len({i.source_id for i in items}) == 20  # without replacement while a domain has rows left
    assert all(i.max_tokens == 7 and len(i.turns) == 1 for i in items)
    assert [i.conversation_id for i in items] == [f"c{k:05d}" for k in range(20)]
    again = dataset_workload(by_domain, 20, mix, rng(1), max_tokens=7)
    assert [i.source_id for i in again] == [i.source_id for i in items]
    other = dataset_workload(by_domain, 20, mix, rng(2), max_tokens=7)
    assert [i.source_id for i in other] != [i.source_id for i in items]


def test_weighted_mix_uses_largest_remainders_and_reuses_rows_when_needed(tmp_path):
    data = write_dataset(tmp_path, {"a": rows("a", ["x", "y"]), "b": rows("b", ["z"] * 3)})
    by_domain = load_rows(data, "all")
    mix = parse_domain_mix("a=3,b=1", list(by_domain))
    assert mix == {"a": 0.75, "b": 0.25}
    items = dataset_workload(by_domain, 10, mix, rng(), max_tokens=4)
    counts = Counter(i.domain for i in items)
    assert counts == {"a": 8, "b": 2}  # 7.5/2.5 → remainders tie, broken by name: a gets the extra
    a_ids = Counter(i.source_id for i in items if i.domain == "a")
    assert sorted(a_ids.values()) == [4, 4]  # 2 rows, each used once per pass
    assert split_counts(7, {"x": 1 / 3, "y": 1 / 3, "z": 1 / 3}) == {"x": 3, "y": 2, "z": 2}


def test_zero_weight_excludes_a_domain(tmp_path):
    data = write_dataset(tmp_path, {"a": rows("a", ["x"]), "b": rows("b", ["y"])})
    mix = parse_domain_mix("a=1,b=0", ["a", "b"])
    items = dataset_workload(load_rows(data, "all"), 3, mix, rng(), max_tokens=4)
    assert {i.domain for i in items} == {"a"}


def test_multi_turn_keeps_all_turns_only_when_asked(tmp_path):
    data = write_dataset(tmp_path, {"mt": [{"id": "mt/1", "domain": "chat/writing", "prompt": "one",
                                            "turns": ["one", "two"]}]})
    by_domain = load_rows(data, "all")
    assert dataset_workload(by_domain, 1, {"chat": 1.0}, rng(), max_tokens=4)[0].turns == ("one",)
    item = dataset_workload(by_domain, 1, {"chat": 1.0}, rng(), max_tokens=4, multi_turn=True)[0]
    assert item.turns == ("one", "two") and item.num_turns == 2


def test_splits(tmp_path):
    data = write_dataset(tmp_path, {"a": rows("a", ["p0", "p1", "p2", "p3", "p4"])})
    assert [r.source_id for r in load_rows(data)["a"]] == ["a/3", "a/4"]
    assert [r.source_id for r in load_rows(data, "first-half")["a"]] == ["a/0", "a/1", "a/2"]
    assert len(load_rows(data, "all")["a"]) == 5


def test_random_workload_lengths_and_token_range():
    items = random_workload(200, rng(3), input_len=20, output_len=10, range_ratio=0.5, token_low=5, token_high=9)
    in_lens = [len(i.prompt_token_ids) for i in items]
    assert min(in_lens) >= 10 and max(in_lens) <= 30 and len(set(in_lens)) > 5
    assert all(5 <= i.max_tokens <= 15 for i in items)
    assert {t for i in items for t in i.prompt_token_ids} == {5, 6, 7, 8}
    assert all(i.domain == "random" and i.turns == () for i in items)
    fixed = random_workload(3, rng(3), input_len=4, output_len=2)
    assert [len(i.prompt_token_ids) for i in fixed] == [4, 4, 4] and [i.max_tokens for i in fixed] == [2, 2, 2]


@pytest.mark.parametrize("content, message", [
    ('{"id": "x", "domain": "a", "prompt": "ok"}\n{not json\n', ":2: not valid JSON"),
    ('["a list"]\n', ":1: expected a JSON object"),
    ('{"id": "x", "domain": "a", "prompt": ""}\n', ":1: 'prompt' must be a non-empty string"),
    ('{"id": "x", "prompt": "p"}\n', ":1: 'domain' must be a non-empty string"),
    ('{"id": "x", "domain": "a", "prompt": "p", "turns": []}\n', ":1: 'turns' must be"),
    ("\n\n", "no prompts"),
])
def test_malformed_dataset_files_name_file_and_line(tmp_path, content, message):
    (tmp_path / "bad.jsonl").write_text(content)
    with pytest.raises(WorkloadError, match=message):
        load_rows(tmp_path)


def test_missing_dataset_dir(tmp_path):
    with pytest.raises(WorkloadError, match="no \\*.jsonl prompt files"):
        load_rows(tmp_path / "nope")


@pytest.mark.parametrize("text, message", [
    ("code=1,poetry=1", "unknown domain 'poetry'"),
    ("code=0,math=0", "sum to more than 0"),
    ("code=-1", ">= 0"),
    ("code=abc", "must be a number"),
    ("code", "DOMAIN=WEIGHT"),
    ("code=1,code=2", "given twice"),
    ("code=inf", "finite"),
])
def test_bad_domain_mix(text, message):
    with pytest.raises(WorkloadError, match=message):
        parse_domain_mix(text, ["code", "math"])


@pytest.mark.parametrize("kw, message", [
    ({"input_len": 0, "output_len": 1}, "must be >= 1"),
    ({"input_len": 1, "output_len": 1, "range_ratio": 1.0}, "range-ratio"),
    ({"input_len": 1, "output_len": 1, "token_low": 9, "token_high": 9}, "token-range"),
])
def test_bad_random_options(kw, message):
    with pytest.raises(WorkloadError, match=message):
        random_workload(2, rng(), **kw)


def test_paths_are_pathlike(tmp_path):
    write_dataset(tmp_path, {"a": rows("a", ["x"])})
    assert load_rows(str(tmp_path), "all") == load_rows(Path(tmp_path), "all")


# ---- repetitive workloads: code editing, repeated templates ----------------------------------------

def test_code_edit_requests_carry_the_function_and_ask_for_all_of_it_back():
    from loadgen.workload import CODE_EDITS, code_edit_workload
    by_domain = load_rows(PACKAGED_PROMPT_DIR)
    items = code_edit_workload(by_domain, 10, rng(3), max_tokens=32)
    assert len(items) == 10 and {i.domain for i in items} == {"code"}
    sources = {r.source_id: r.turns[0] for r in by_domain["code"]}
    for item in items:
        (text,) = item.turns
        original = sources[item.source_id.removesuffix("#edit")]
        code = original.removeprefix("Complete the following Python function.").strip("\n")
        assert code and code in text  # the whole function travels in the request
        assert "Complete the following Python function." not in text
        assert any(edit in text for edit in CODE_EDITS)
        assert "complete function" in text
    # seeded: the same seed, the same requests; another seed, other ones
    assert [i.turns for i in code_edit_workload(by_domain, 10, rng(3), max_tokens=32)] == [i.turns for i in items]
    assert [i.turns for i in code_edit_workload(by_domain, 10, rng(4), max_tokens=32)] != [i.turns for i in items]


def test_code_edit_needs_code_rows(tmp_path):
    from loadgen.workload import code_edit_workload
    data = write_dataset(tmp_path, {"math": rows("math", ["1+1?"])})
    with pytest.raises(WorkloadError, match="code"):
        code_edit_workload(load_rows(data, "all"), 2, rng(), max_tokens=4)


def test_template_traffic_repeats_popular_questions_under_one_template_per_domain():
    from loadgen.workload import TEMPLATES, template_workload
    by_domain = load_rows(PACKAGED_PROMPT_DIR)
    mix = parse_domain_mix(None, list(by_domain))
    items = template_workload(by_domain, 80, mix, rng(5), max_tokens=16, pool_size=6)
    assert Counter(i.domain for i in items) == {"code": 20, "math": 20, "instruction": 20, "chat": 20}
    for domain in by_domain:
        texts = [i.turns[0] for i in items if i.domain == domain]
        head = TEMPLATES[domain].split("{question}")[0]
        assert all(t.startswith(head) for t in texts)
        pool = {r.turns[0] for r in by_domain[domain][:6]}
        assert {t[len(head):] for t in texts} <= pool  # questions only from the domain's small pool
        counts = Counter(texts).most_common()
        assert counts[0][1] >= 4  # the most popular question arrives again and again (Zipf)
        assert counts[0][1] > counts[-1][1]


def test_warm_up_and_measured_template_pools_never_share_a_question():
    from loadgen.workload import template_workload
    first, second = load_rows(PACKAGED_PROMPT_DIR, "first-half"), load_rows(PACKAGED_PROMPT_DIR, "second-half")
    mix = parse_domain_mix(None, list(first))
    warm = {i.turns[0] for i in template_workload(first, 40, mix, rng(1), max_tokens=8)}
    measured = {i.turns[0] for i in template_workload(second, 40, mix, rng(1), max_tokens=8)}
    assert warm and measured and not warm & measured


def test_build_workload_names_every_workload_and_refuses_others():
    from loadgen.workload import WORKLOADS, build_workload
    by_domain = load_rows(PACKAGED_PROMPT_DIR)
    mix = parse_domain_mix(None, list(by_domain))
    for name in WORKLOADS:
        items = build_workload(name, by_domain, 8, mix, rng(), max_tokens=8)
        assert len(items) == 8
        assert all(i.num_turns == (2 if name == "multi-turn" else 1) for i in items)
    with pytest.raises(WorkloadError, match="unknown workload"):
        build_workload("nope", by_domain, 8, mix, rng(), max_tokens=8)
