"""End to end: the real ``cosine-ray serve`` CLI on the session's Ray cluster, real model.

The CLI joins the session cluster (``--address``; ``ray_cluster`` in conftest.py) and deploys the
Serve app: the engine deployment with 2 pipeline stages and the ngram + retrieval drafters for
SmolLM2-135M-Instruct, and the OpenAI ingress. The official ``openai`` client
and httpx talk to it over TCP; every text must equal transformers' greedy decoding of the same
prompt ids (chat-templated via ``encode_prompt``, or plain for /v1/completions). The last test
stops the CLI with SIGINT and checks that the Serve app, engine, stages and drafters are gone;
the fixture's teardown also escalates to SIGKILL and cleans up whatever is left.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

ray = pytest.importorskip("ray")
openai = pytest.importorskip("openai")

from support.cli_server import free_port, log_tail, stop_cli, wait_until_serving  # noqa: E402
from cosine_ray.datasets import PACKAGED_PROMPT_DIR  # noqa: E402
from cosine_ray.engine.local import encode_prompt  # noqa: E402
from cosine_ray.runtime.cluster import actor_name  # noqa: E402
from support.engine_app import (engine_actor, engine_call, engine_replicas, force_cleanup,  # noqa: E402
                                ingress_replicas, our_actors, wait_gone)

pytestmark = [pytest.mark.ray, pytest.mark.real_model]

PROMPTS_DIR = PACKAGED_PROMPT_DIR
MAX_TOKENS = 32
READY_TIMEOUT_S = 360.0
REQUEST_TIMEOUT_S = 180.0
NEAR_TIE = 1e-3
"""Prompts whose greedy reference has a top-2 logit gap below this are skipped (batched and
pipelined fp32 math may legitimately flip an exact tie)."""
DRAFTER0 = actor_name("drafter", 0)  # ngram (first in --drafters)


def _timed(label: str, start: float) -> None:
    print(f"[serve-e2e] {label}: {time.perf_counter() - start:.1f} s", flush=True)


# ---- references --------------------------------------------------------------------------------

def held_out_prompts() -> list[tuple[str, list[str]]]:
    """(file, prompts of the second half of the file) for every prompt file."""
    out = []
    for path in sorted(PROMPTS_DIR.glob("*.jsonl")):
        rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        out.append((path.stem, [r["prompt"] for r in rows[(len(rows) + 1) // 2:]]))
    return out


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], float]:
    """Greedy continuation and its smallest top-2 logit gap."""
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, num_beams=1, temperature=None, top_p=None, top_k=None,
                             pad_token_id=model.generation_config.pad_token_id or 0,
                             output_logits=True, return_dict_in_generate=True)
    gaps = [float(v[0] - v[1]) for v in (lg[0].float().topk(2).values for lg in out.logits)]
    return out.sequences[0, len(prompt_ids):].tolist(), min(gaps)


@dataclass
class Case:
    source: str
    text: str
    prompt_ids: list[int]
    ref_ids: list[int]
    ref_text: str

    @property
    def finish_reason(self) -> str:
        return "length" if len(self.ref_ids) == MAX_TOKENS else "stop"


@dataclass
class Server:
    url: str
    proc: subprocess.Popen
    log_path: Path
    model: str = ""
    chat: list[Case] = field(default_factory=list)
    completion: list[Case] = field(default_factory=list)
    tok: Any = None

    def log_tail(self, n: int = 60) -> str:
        return log_tail(self.log_path, n)


def build_cases(hf, tok) -> tuple[list[Case], list[Case]]:
    """One chat prompt per file (4) and two completion prompts, skipping near-tie references."""
    chat, completion = [], []
    for source, texts in held_out_prompts():
        for text in texts[:4]:
            ids = encode_prompt(tok, text)
            ref, gap = hf_greedy(hf, ids, MAX_TOKENS)
            if gap < NEAR_TIE:
                print(f"[serve-e2e] skipping a {source} prompt: near-tie reference (gap {gap:.2e})")
                continue
            chat.append(Case(source, text, ids, ref, tok.decode(ref, skip_special_tokens=True)))
            break
    for source, texts in held_out_prompts()[:2]:
        for text in texts[1:5]:
            ids = [int(t) for t in tok(text, add_special_tokens=True)["input_ids"]]
            ref, gap = hf_greedy(hf, ids, MAX_TOKENS)
            if gap >= NEAR_TIE:
                completion.append(Case(source, text, ids, ref, tok.decode(ref, skip_special_tokens=True)))
                break
    assert len(chat) == 4 and len(completion) == 2
    return chat, completion


# ---- the server --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(ray_cluster, tmp_path_factory, real_checkpoint, real_hf_model) -> Server:
    port = free_port()
    log_path = tmp_path_factory.mktemp("serve-e2e") / "cli.log"
    exe = shutil.which("cosine-ray")
    cmd = ([exe] if exe else [sys.executable, "-m", "cosine_ray.cli"]) + [
        "serve", "--port", str(port), "--address", ray_cluster, "--drafters", "ngram,retrieval",
        "--drafters-in-engine", "retrieval", "--stages", "2",
        "--weights", "dense"]  # ngram in an actor (killed below), retrieval in the engine
    start = time.perf_counter()
    log = open(log_path, "wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    srv = Server(f"http://127.0.0.1:{port}", proc, log_path)
    try:
        # the references are computed while the cluster loads the model
        ref_start = time.perf_counter()
        tok = srv.tok = real_checkpoint.load_tokenizer()
        srv.chat, srv.completion = build_cases(real_hf_model, tok)
        _timed("HF greedy references", ref_start)
        wait_until_serving(proc, log_path, READY_TIMEOUT_S)
        _timed("cosine-ray serve ready (CLI start to 'serving OpenAI API')", start)
        srv.model = httpx.get(f"{srv.url}/v1/models", timeout=30).json()["data"][0]["id"]
        yield srv
    finally:
        stop_start = time.perf_counter()
        rc = stop_cli(proc)
        log.close()
        left = wait_gone(30.0)
        if left:
            print(f"[serve-e2e] left behind after the CLI exited ({rc}): {left}; cleaning up")
            force_cleanup()
            left = wait_gone(30.0)
        _timed(f"CLI stopped (exit {rc})", stop_start)
        print(f"[serve-e2e] CLI log tail:\n{srv.log_tail(15)}")
        assert not left, f"actors still alive after cleanup: {left}"


@pytest.fixture(scope="module")
def oai(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", timeout=REQUEST_TIMEOUT_S, max_retries=0)


@pytest.fixture(scope="module")
def aoai(server):
    """A factory (an AsyncOpenAI client is bound to the event loop it is used on)."""
    return lambda: openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x",
                                      timeout=REQUEST_TIMEOUT_S, max_retries=0)


def run(coro, timeout_s: float = REQUEST_TIMEOUT_S):
    return asyncio.run(asyncio.wait_for(coro, timeout=timeout_s))


async def stream_chat(url: str, case: Case, *, model: str, on_chunk=None) -> dict[str, Any]:
    """Raw SSE over httpx: the text, the number of [DONE] lines, finish reasons and usage."""
    body = {"model": model, "messages": [{"role": "user", "content": case.text}], "max_tokens": MAX_TOKENS,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    out: dict[str, Any] = {"text": "", "done": 0, "finish": [], "usage": None, "events": 0, "after_done": 0}
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S) as client:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as resp:
            assert resp.status_code == 200, await resp.aread()
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if out["done"]:
                    out["after_done"] += 1
                if data == "[DONE]":
                    out["done"] += 1
                    continue
                event = json.loads(data)
                assert "error" not in event, event
                out["events"] += 1
                if event.get("usage"):
                    out["usage"] = event["usage"]
                for choice in event["choices"]:
                    out["text"] += choice["delta"].get("content") or ""
                    if choice.get("finish_reason"):
                        out["finish"].append(choice["finish_reason"])
                if on_chunk is not None:
                    on_chunk(out)
    return out


def check_usage(usage: Any, case: Case) -> None:
    usage = usage if isinstance(usage, dict) else usage.model_dump()
    assert usage["prompt_tokens"] == len(case.prompt_ids)
    assert usage["completion_tokens"] == len(case.ref_ids)
    assert usage["total_tokens"] == len(case.prompt_ids) + len(case.ref_ids)


# ---- tests -------------------------------------------------------------------------------------

def test_health_and_models(server):
    r = httpx.get(f"{server.url}/health", timeout=30)
    assert r.status_code == 200 and r.json() == {"status": "ok"}
    models = httpx.get(f"{server.url}/v1/models", timeout=30).json()
    assert [m["id"] for m in models["data"]] == [server.model]


def test_chat_matches_hf_greedy(server, aoai):
    async def main():
        client = aoai()
        return await asyncio.gather(*(client.chat.completions.create(
            model=server.model, messages=[{"role": "user", "content": c.text}], max_tokens=MAX_TOKENS,
            temperature=0) for c in server.chat))

    start = time.perf_counter()
    responses = run(main())
    _timed(f"{len(server.chat)} concurrent chat completions", start)
    for case, resp in zip(server.chat, responses):
        choice = resp.choices[0]
        assert choice.message.content == case.ref_text, f"{case.source}: chat text differs from HF greedy"
        assert choice.message.role == "assistant"
        assert choice.finish_reason == case.finish_reason
        check_usage(resp.usage, case)


def test_completion_matches_hf_greedy(server, oai):
    start = time.perf_counter()
    for case in server.completion:
        resp = oai.completions.create(model=server.model, prompt=case.text, max_tokens=MAX_TOKENS, temperature=0)
        assert resp.choices[0].text == case.ref_text, f"{case.source}: completion differs from HF greedy"
        assert resp.choices[0].finish_reason == case.finish_reason
        check_usage(resp.usage, case)
    _timed(f"{len(server.completion)} completions", start)


def test_a_stop_string_ends_text_usage_and_logprobs_at_its_token(server, oai):
    """Not streamed, the engine's outputs reach the ingress merged (0.1 s apart), so the stop
    string is found some tokens late: those leave the text, the usage and the log-probabilities."""
    cases = [case for case in server.completion if len(case.ref_text) >= 12]  # an EOS may end one early
    assert cases, [case.ref_text for case in server.completion]
    for case in cases:
        at = 2 * len(case.ref_text) // 3
        stop = case.ref_text[at:at + 4]
        text = case.ref_text[:case.ref_text.find(stop)]
        num_tokens = next(n for n in range(1, len(case.ref_ids) + 1)
                          if stop in server.tok.decode(case.ref_ids[:n], skip_special_tokens=True))
        resp = oai.completions.create(model=server.model, prompt=case.text, max_tokens=MAX_TOKENS, temperature=0,
                                      stop=[stop], logprobs=1)
        choice = resp.choices[0]
        assert (choice.text, choice.finish_reason) == (text, "stop"), case.source
        assert resp.usage.completion_tokens == len(choice.logprobs.tokens) == num_tokens, case.source


def test_streaming_chat_matches_hf_greedy(server, aoai):
    async def one(client, case: Case) -> tuple[str, list[str], Any]:
        stream = await client.chat.completions.create(
            model=server.model, messages=[{"role": "user", "content": case.text}], max_tokens=MAX_TOKENS,
            temperature=0, stream=True, stream_options={"include_usage": True})
        text, finish, usage = "", [], None
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                text += choice.delta.content or ""
                if choice.finish_reason:
                    finish.append(choice.finish_reason)
        return text, finish, usage

    async def main():
        client = aoai()
        return await asyncio.gather(*(one(client, c) for c in server.chat))

    start = time.perf_counter()
    results = run(main())
    _timed(f"{len(server.chat)} concurrent streaming chats (openai client)", start)
    for case, (text, finish, usage) in zip(server.chat, results):
        assert text == case.ref_text, f"{case.source}: streamed text differs from HF greedy"
        assert finish == [case.finish_reason]
        assert usage is not None
        check_usage(usage, case)


def test_eight_concurrent_streams_each_end_with_one_done(server):
    cases = (server.chat * 2)[:8]

    async def main():
        return await asyncio.gather(*(stream_chat(server.url, c, model=server.model) for c in cases))

    start = time.perf_counter()
    results = run(main())
    _timed("8 concurrent streaming chats (httpx)", start)
    for case, out in zip(cases, results):
        assert out["done"] == 1 and out["after_done"] == 0
        assert out["text"] == case.ref_text, f"{case.source}: text differs under concurrency"
        assert out["finish"] == [case.finish_reason]
        check_usage(out["usage"], case)


def test_drafter_killed_during_stream_keeps_text(server):
    before = engine_call("stats", timeout_s=60)
    drafter = engine_actor(DRAFTER0)
    old = ray.get(drafter.ping.remote(), timeout=60)
    case = server.chat[0]
    state = {"killed_at": None}

    def kill_on_first_text(out: dict[str, Any]) -> None:
        if state["killed_at"] is None and out["text"]:
            ray.kill(drafter)  # no_restart=True: the engine's slot respawns it
            state["killed_at"] = out["events"]

    start = time.perf_counter()
    out = run(stream_chat(server.url, case, model=server.model, on_chunk=kill_on_first_text))
    _timed(f"streaming chat with {DRAFTER0} killed after event {state['killed_at']} of {out['events']}", start)
    assert state["killed_at"] is not None and out["events"] > state["killed_at"] + 1, \
        "the kill did not land mid-stream"
    assert out["text"] == case.ref_text
    assert out["done"] == 1 and out["finish"] == [case.finish_reason]
    check_usage(out["usage"], case)

    # the drafter was respawned by the engine's slot and answers again
    stats = engine_call("stats", timeout_s=60)
    print(f"[serve-e2e] after the kill: failures={stats['drafter_failures']} respawns={stats['respawns']}")
    assert stats["respawns"][DRAFTER0] == before["respawns"][DRAFTER0] + 1
    deadline = time.monotonic() + 180
    while True:
        try:
            if ray.get(engine_actor(DRAFTER0).ping.remote(), timeout=10) != old:
                break
        except Exception:
            pass
        assert time.monotonic() < deadline, f"{DRAFTER0} did not come back"
        time.sleep(0.5)
    r = httpx.get(f"{server.url}/health", timeout=30)
    assert r.status_code == 200


def test_bad_requests_get_openai_400s(server, oai):
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "hi"}],
                                    max_tokens=0, temperature=0)
    assert info.value.status_code == 400
    err = info.value.response.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["param"] == "max_tokens"

    cases = [  # (body bytes, expected param)
        (b'{"model": "m", "messages": [', None),  # malformed JSON
        (json.dumps({"max_tokens": 4}).encode(), "messages"),  # missing messages
        (json.dumps({"messages": [{"role": "user", "content": "hi"}], "temperature": -0.1}).encode(),
         "temperature"),
    ]
    for body, param in cases:
        r = httpx.post(f"{server.url}/v1/chat/completions", content=body,
                       headers={"content-type": "application/json"}, timeout=30)
        assert r.status_code == 400, (body, r.status_code, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
        assert err["param"] == param, (body, err)
        assert "Traceback" not in r.text
    r = httpx.post(f"{server.url}/v1/completions", timeout=30,
                   json={"model": server.model, "prompt": [10**9], "max_tokens": 4})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    # still healthy
    assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200


def test_replaced_ingress_replica_keeps_the_engine(server):
    """Serve replaces a dead ingress replica; the engine deployment (and its loaded stages and
    drafters) is untouched, and the new replica talks to it (reliability guide: replacing an
    ingress replica never kills in-flight generation)."""
    engine_before = engine_call("describe", timeout_s=60)["engine_id"]
    stage0 = ray.get(engine_actor(actor_name("stage", 0)).ping.remote(), timeout=60)
    replicas = ingress_replicas()
    assert len(replicas) == 1 and len(engine_replicas()) == 1, our_actors()
    start = time.perf_counter()
    ray.kill(ray.get_actor(replicas[0], namespace="serve"), no_restart=True)
    deadline = time.monotonic() + 300
    while True:
        new = ingress_replicas()
        try:
            healthy = bool(new) and new != replicas and httpx.get(f"{server.url}/health", timeout=10).status_code == 200
        except httpx.HTTPError:
            healthy = False
        if healthy:
            break
        assert time.monotonic() < deadline, f"no healthy replica 300 s after the kill:\n{server.log_tail()}"
        time.sleep(1.0)
    _timed("ingress replica replaced and healthy", start)
    case = server.chat[1]
    out = run(stream_chat(server.url, case, model=server.model))
    assert out["text"] == case.ref_text and out["done"] == 1
    engine_after = engine_call("describe", timeout_s=60)["engine_id"]
    new_stage0 = ray.get(engine_actor(actor_name("stage", 0)).ping.remote(), timeout=60)
    assert (engine_after, new_stage0) == (engine_before, stage0), \
        "a replaced ingress replica must reuse the running engine, not rebuild it"


def test_sigint_shuts_down_cleanly(server):
    """Last: Ctrl-C deletes the Serve app: the engine goes, with its stages and drafters."""
    assert engine_replicas() and any(n.startswith("cosine_ray:stage:") for _, n in our_actors())
    start = time.perf_counter()
    rc = stop_cli(server.proc)
    _timed(f"SIGINT -> CLI exit {rc}", start)
    assert rc == 0, server.log_tail()
    left = wait_gone(30.0)
    assert not left, f"left behind after Ctrl-C: {left}"
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{server.url}/health", timeout=5)
