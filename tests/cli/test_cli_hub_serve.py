"""End to end, as a vLLM user starts it: ``cosine-ray serve HuggingFaceTB/SmolLM2-135M-Instruct
--max-model-len 2048`` with ``HF_HUB_OFFLINE=1`` and a Hub cache (``HF_HOME``) holding the
embedded model under its Hub id, on a local cluster the CLI starts, with the default drafters
(the embedded model's packaged datastores serve its Hub id). The model card says the id and the
context, a chat completion is transformers' greedy text, and the console is quiet: each line
once, no access log, no internal calls, and the engine's stats line."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import httpx
import pytest

from cosine_ray.engine.local import encode_prompt
from support.cli_server import free_port, log_tail, stop_cli, wait_until_serving
from support.hf_reference import hf_greedy
from support.hub_cache import SMOL_FILES, SMOL_REPO, write_checkpoint_cache

pytestmark = [pytest.mark.full, pytest.mark.real_model]

READY_TIMEOUT_S = 600.0
STATS_LINE = "Avg generation throughput:"


def test_serve_a_hub_id_offline_with_a_quiet_console(tmp_path, real_checkpoint, real_hf_model):
    home = tmp_path / "hf"
    write_checkpoint_cache(home / "hub", SMOL_REPO, real_checkpoint.path, names=SMOL_FILES)
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_CACHE", "RAY_ADDRESS")}
    env.update(HF_HOME=str(home), HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    port = free_port()
    exe = shutil.which("cosine-ray")
    cmd = ([exe] if exe else [sys.executable, "-m", "cosine_ray.cli"]) + [
        "serve", SMOL_REPO, "--port", str(port), "--max-model-len", "2048", "--pipeline-parallel-size", "1"]
    log_path = tmp_path / "cli.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
    try:
        wait_until_serving(proc, log_path, READY_TIMEOUT_S)
        url = f"http://127.0.0.1:{port}"
        (card,) = httpx.get(f"{url}/v1/models", timeout=30).json()["data"]
        assert card["id"] == SMOL_REPO and card["max_model_len"] == 2048
        tokenizer = real_checkpoint.load_tokenizer()
        prompt = "Write a Python function that reverses a string."
        reference = hf_greedy(real_hf_model, encode_prompt(tokenizer, prompt), 24)
        for _ in range(2):
            r = httpx.post(f"{url}/v1/chat/completions", timeout=300, json={
                "model": SMOL_REPO, "messages": [{"role": "user", "content": prompt}], "max_tokens": 24,
                "temperature": 0})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["message"]["content"] == tokenizer.decode(reference,
                                                                                   skip_special_tokens=True)
        deadline = time.monotonic() + 30
        while STATS_LINE not in log_path.read_text(errors="replace") and time.monotonic() < deadline:
            time.sleep(0.5)
        text = log_path.read_text(errors="replace")
        assert STATS_LINE in text, log_tail(log_path)
        stats = next(line for line in text.splitlines() if STATS_LINE in line)
        assert "Running:" in stats and "Draft acceptance rate:" in stats, stats
        assert "CALL record_http" not in text and "/v1/chat/completions" not in text, log_tail(log_path)
        lines = [line for line in text.splitlines() if line.strip()]
        assert all(a != b for a, b in zip(lines, lines[1:])), "a line printed twice:\n" + log_tail(log_path)
    finally:
        code = stop_cli(proc)
    assert code == 0, log_tail(log_path)
