"""cosine_ray/datasets.py: the packaged prompt sets, their fixed split, and the commands that
default to them (bench, datastore build; loadgen has its own tests in tests/loadgen)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from cosine_ray import datasets
from cosine_ray.datasets import (DOMAIN_FILES, PACKAGED_PROMPT_DIR, default_prompt_dir, domain_file, domain_prompts,
                                 first_half, held_back_prompts, read_prompts, second_half, split_point, split_rows)

ROWS = {"code": 164, "math": 1319, "instruction": 175, "chat": 80}


def test_packaged_prompt_sets_are_complete():
    assert PACKAGED_PROMPT_DIR.is_dir()
    assert sorted(p.name for p in PACKAGED_PROMPT_DIR.glob("*.jsonl")) == sorted(DOMAIN_FILES.values())
    for domain, name in DOMAIN_FILES.items():
        rows = read_prompts(PACKAGED_PROMPT_DIR / name)
        assert len(rows) == ROWS[domain], name
        assert len({r["id"] for r in rows}) == len(rows), f"{name}: duplicate ids"
        assert all(r["domain"].split("/")[0] == domain for r in rows), name
    assert all(len(r["turns"]) == 2 for r in read_prompts(domain_file("chat", PACKAGED_PROMPT_DIR)))


def test_licence_notes_ship_with_the_data():
    notes = (PACKAGED_PROMPT_DIR / "README.md").read_text(encoding="utf-8")
    for name in DOMAIN_FILES.values():
        assert f"`{name}`" in notes
    assert "CC BY-NC 4.0" in notes and "non-commercial" in notes


def test_default_dir_is_packaged_unless_overridden(monkeypatch, tmp_path):
    monkeypatch.delenv("COSINE_RAY_PROMPTS", raising=False)
    assert default_prompt_dir() == PACKAGED_PROMPT_DIR
    assert domain_file("math") == PACKAGED_PROMPT_DIR / "gsm8k.jsonl"
    monkeypatch.setenv("COSINE_RAY_PROMPTS", str(tmp_path))
    assert default_prompt_dir() == tmp_path
    assert domain_file("code") == tmp_path / "humaneval.jsonl"
    with pytest.raises(KeyError, match="no packaged prompt set for domain 'legal'"):
        domain_file("legal", error=KeyError)


@pytest.mark.parametrize("n", [0, 1, 2, 5, 80, 175])
def test_split_halves_partition_the_rows(n):
    rows = list(range(n))
    first, second = first_half(rows), second_half(rows)
    assert first + second == rows and len(first) == split_point(n) == (n + 1) // 2
    assert split_rows(rows, "first-half") == first and split_rows(rows, "second-half") == second
    assert split_rows(rows, "all") == rows


def test_split_rows_rejects_unknown_split():
    with pytest.raises(KeyError, match="split must be one of first-half, second-half, all"):
        split_rows([1], "middle", KeyError)


def test_held_back_prompts_are_the_second_halves_in_domain_order():
    got = held_back_prompts(PACKAGED_PROMPT_DIR, 3)
    assert [d for d, _ in got] == [d for d in DOMAIN_FILES for _ in range(3)]
    for domain in DOMAIN_FILES:
        expected = [r["prompt"] for r in domain_prompts(domain, "second-half", PACKAGED_PROMPT_DIR)][:3]
        assert [p for d, p in got if d == domain] == expected
    everything = held_back_prompts(PACKAGED_PROMPT_DIR, None)
    assert len(everything) == sum(n - split_point(n) for n in ROWS.values())


@pytest.mark.parametrize("content, message", [
    (None, "does not exist"),
    ("", "has no prompts"),
    ('{"prompt": "a"}\nnot json\n', ":2: not valid JSON"),
    ('["a list"]\n', ":1: expected a JSON object with a 'prompt'"),
    ('{"id": 1}\n', ":1: 'prompt' must be a non-empty string"),
    ('{"prompt": "  "}\n', ":1: 'prompt' must be a non-empty string"),
])
def test_read_prompts_errors_are_one_line(tmp_path, content, message):
    path = tmp_path / "p.jsonl"
    if content is not None:
        path.write_text(content)
    with pytest.raises(KeyError, match=message):
        read_prompts(path, KeyError)


def test_datasets_imports_nothing_heavy():
    code = ("import sys, cosine_ray.datasets; "
            "print([m for m in ('torch', 'ray', 'numpy', 'transformers') if m in sys.modules])")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_bench_reads_the_packaged_prompts():
    """bench measures on the held-back half and warms up on the other half of each file."""
    from cosine_ray import cli
    from cosine_ray.cli import bench
    assert bench.DEFAULT_PROMPT_DIR == default_prompt_dir()
    for workload in ("chat", "template"):
        args = cli.build_parser().parse_args(["bench", "--workload", workload, "--prompts-per-domain", "2",
                                              "--warmup-per-domain", "2", "--prompt-dir", str(PACKAGED_PROMPT_DIR)])
        warm, measured = bench.build_conversations(args)
        assert len(warm) == len(measured) == 8
        held = {r["id"] for name in DOMAIN_FILES.values()
                for r in datasets.second_half(datasets.read_prompts(PACKAGED_PROMPT_DIR / name))}
        assert all(i.source_id.split("#")[0] in held for i in measured)
        assert not any(i.source_id.split("#")[0] in held for i in warm)


def _datastore_args(argv: list[str]):
    from cosine_ray import cli
    from cosine_ray.cli import datastore
    return datastore, cli.build_parser().parse_args(["datastore", "build", *argv])


def test_datastore_build_defaults_to_the_packaged_file_of_its_domain(monkeypatch):
    monkeypatch.delenv("COSINE_RAY_PROMPTS", raising=False)
    cli, args = _datastore_args(["--domain", "instruction", "--limit", "3"])
    rows = cli._datastore_rows(args)
    assert Path(args.prompts) == PACKAGED_PROMPT_DIR / "alpaca.jsonl"
    assert rows == domain_prompts("instruction", "first-half", PACKAGED_PROMPT_DIR)[:3]
    cli, args = _datastore_args(["--domain", "chat"])
    assert cli._datastore_rows(args) == domain_prompts("chat", "first-half", PACKAGED_PROMPT_DIR)


def test_datastore_build_needs_prompts_for_an_unpackaged_domain(capsys):
    from cosine_ray import cli
    assert cli.main(["datastore", "build", "--domain", "legal"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["cosine-ray: error: --prompts is required for domain 'legal' "
                   "(packaged prompt sets: code, math, instruction, chat)"]


def test_datastore_build_reads_a_given_file(tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"p{i}"}) + "\n" for i in range(5)))
    cli, args = _datastore_args(["--domain", "legal", "--prompts", str(path), "--split", "all"])
    assert [r["prompt"] for r in cli._datastore_rows(args)] == [f"p{i}" for i in range(5)]
    cli, args = _datastore_args(["--domain", "legal", "--prompts", str(path)])
    assert [r["prompt"] for r in cli._datastore_rows(args)] == ["p0", "p1", "p2"]


def test_bench_system_overrides_take_lists_and_reject_bad_values():
    """``DRAFTERS@key=value,...``: a [a, b] value is one override (its commas are not
    separators); a value the engine config refuses, or a name it does not have, is a CliError
    naming the system."""
    from cosine_ray.cli import bench
    from cosine_ray.cli.args import CliError

    (system,) = bench.parse_systems("ngram,suffix@shared_drafters=[ngram, suffix],drafters_per_request=1")
    assert system.drafters == "ngram,suffix"
    assert system.settings == {"shared_drafters": ["ngram", "suffix"], "drafters_per_request": 1}
    with pytest.raises(CliError, match="routing"):
        bench.parse_systems("default@routing=nowhere")
    with pytest.raises(CliError, match="no_such_setting"):
        bench.parse_systems("default@no_such_setting=1")


def test_bench_splits_acceptance_into_first_sends_and_repeats():
    """The template workload repeats popular questions word for word; bench reports their
    acceptance apart from first sends', and nothing when no conversation repeats."""
    from types import SimpleNamespace

    from cosine_ray import cli
    from cosine_ray.cli import bench

    def turn(steps: int, accepted: int) -> bench.Turn:
        return bench.Turn([1] * (steps + accepted), "length",
                          SimpleNamespace(num_verify_steps=steps, num_accepted_tokens=accepted,
                                          num_draft_tokens=2 * accepted or 1))

    prompts = [("a",), ("b",), ("a",), ("a",), ("c",)]
    outs = [[turn(10, 10)], [turn(20, 0)], [turn(4, 28)], [turn(5, 30)], [turn(10, 5)]]
    split = bench._by_repeat(outs, prompts)
    assert split["first_sends"] == 3 and split["repeats"] == 2
    assert split["first"]["mean_accepted_length"] == pytest.approx((15 + 40) / 40)
    assert split["repeat"]["mean_accepted_length"] == pytest.approx((58 + 9) / 9)
    assert bench._by_repeat(outs[:2], prompts[:2]) is None
    args = cli.build_parser().parse_args(["bench", "--workload", "template", "--prompts-per-domain", "8",
                                          "--prompt-dir", str(PACKAGED_PROMPT_DIR)])
    _, measured = bench.build_conversations(args)
    texts = [i.turns for i in measured]
    assert len(set(texts)) < len(texts)  # 8 a domain from a pool of 6: the workload does repeat


def test_bench_pairs_each_ratio_with_its_round_and_summarises_the_rounds():
    """``--rounds``: each ratio is to the same round's ``none``; the summary holds the median and
    min-max (the rounds' order: tests/bench/test_interleaved_rounds.py)."""
    from cosine_ray import cli
    from cosine_ray.cli import bench

    def row(system, rnd, tok_s, same="8/8"):
        return {"system": system, "concurrency": 8, "round": rnd, "tokens_per_s": tok_s, "lossless_identical": same,
                "ratio_vs_off": tok_s / {1: 100.0, 2: 200.0, 3: 150.0}[rnd]}

    rows = [row("none", 1, 100.0), row("none", 2, 200.0), row("none", 3, 150.0),
            row("default", 1, 130.0), row("default", 2, 220.0), row("default", 3, 180.0, "7/8")]
    summary = {e["system"]: e for e in bench.summarize_rounds(rows)}
    d = summary["default"]
    assert d["rounds"] == 3 and d["tokens_per_s"] == 180.0
    assert d["ratio_vs_off"] == pytest.approx(1.2) and d["ratio_min"] == pytest.approx(1.1)
    assert d["ratio_max"] == pytest.approx(1.3) and d["identical_every_round"] is False
    assert summary["none"]["identical_every_round"] is True and summary["none"]["ratio_vs_off"] == 1.0
    assert cli.main(["bench", "--rounds", "0"]) == 2  # one line on stderr, exit 2
