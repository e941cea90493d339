"""``loadgen.prompt_sets``: the one reader of the prompt files (cosine_ray.datasets and
loadgen.workload both read through it), its line-numbered errors and its fixed split."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from cosine_ray import datasets
from cosine_ray.datasets import DOMAIN_FILES, PACKAGED_PROMPT_DIR
from loadgen import prompt_sets
from loadgen.prompt_sets import SPLITS, default_prompt_dir, packaged_prompt_dir, read_prompt_lines, split_rows
from loadgen.workload import WorkloadError, load_rows


def test_rows_keep_their_line_numbers_past_blank_lines(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('\n{"prompt": "a", "id": 1}\n\n  \n{"prompt": "b"}\n', encoding="utf-8")
    assert read_prompt_lines(path) == [(2, {"prompt": "a", "id": 1}), (5, {"prompt": "b"})]


@pytest.mark.parametrize("content, message", [
    (None, "prompt file .* does not exist"),
    ("\n\n", "prompt file .* has no prompts"),
    ('{"prompt": "a"}\n{nope\n', r"p\.jsonl:2: not valid JSON"),
    ('["a list"]\n', r"p\.jsonl:1: expected a JSON object with a 'prompt'"),
    ('{"prompt": 3}\n', r"p\.jsonl:1: 'prompt' must be a non-empty string"),
    (b'{"prompt": "\xff"}\n', "cannot read .*p.jsonl"),
])
def test_a_bad_file_is_one_line_of_the_callers_error_type(tmp_path, content, message):
    path = tmp_path / "p.jsonl"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content, encoding="utf-8")
    with pytest.raises(KeyError, match=message) as info:
        read_prompt_lines(path, KeyError)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("n", [0, 1, 4, 7])
def test_the_odd_row_goes_to_the_first_half(n):
    rows = list(range(n))
    first, second = split_rows(rows, "first-half"), split_rows(rows, "second-half")
    assert first + second == rows and len(first) == (n + 1) // 2 and split_rows(rows, "all") == rows
    assert set(SPLITS) == {"first-half", "second-half", "all"}
    with pytest.raises(WorkloadError, match="split must be one of"):
        split_rows(rows, "middle", WorkloadError)


def test_the_packaged_folder_is_cosine_rays_and_the_environment_overrides_it(monkeypatch, tmp_path):
    monkeypatch.delenv("COSINE_RAY_PROMPTS", raising=False)
    assert packaged_prompt_dir() == PACKAGED_PROMPT_DIR == default_prompt_dir()
    assert default_prompt_dir(tmp_path) == tmp_path  # a caller's own packaged folder
    monkeypatch.setenv("COSINE_RAY_PROMPTS", str(tmp_path / "mine"))
    assert default_prompt_dir() == default_prompt_dir(PACKAGED_PROMPT_DIR) == tmp_path / "mine"


def test_cosine_ray_and_loadgen_read_the_same_rows():
    by_domain = load_rows(PACKAGED_PROMPT_DIR, "all")
    for domain, name in DOMAIN_FILES.items():
        rows = datasets.read_prompts(PACKAGED_PROMPT_DIR / name)
        assert [r.source_id for r in by_domain[domain]] == [r["id"] for r in rows]
        assert [r.turns[0] for r in by_domain[domain]] == [r["prompt"] for r in rows]


def test_the_reader_imports_only_the_standard_library():
    """loadgen never imports cosine_ray (its import sets the OpenMP and oneDNN environment), and
    cosine_ray.datasets stays free of numpy: the shared reader imports neither."""
    code = ("import sys, loadgen.prompt_sets; "
            "print([m for m in ('cosine_ray', 'numpy', 'torch', 'httpx') if m in sys.modules])")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().replace("'", '"')) == []
    assert prompt_sets.PROMPTS_ENV == datasets.PROMPTS_ENV == "COSINE_RAY_PROMPTS"
