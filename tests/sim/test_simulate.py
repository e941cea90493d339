"""``cosine-ray simulate``: the real engine on a simulated deployment (``cosine_ray.sim``).

Every run here goes through the real ``EngineCore`` on the virtual clock; the runner itself
fails a run whose text is not the oracle's, so each test is also a losslessness check. Timing
expectations are derived from the scenario's latency model, link sizes and the module formulas,
not read back from a run."""

from __future__ import annotations

import copy
import json
import math
import statistics
from pathlib import Path

import pytest
import yaml

from cosine_ray.cli import main as cli_main
from cosine_ray.algo.scheduling.latency_model import LatencyModel, LlmSample
from cosine_ray.sim.latency import DrafterCost, TargetCost, target_cost
from cosine_ray.sim.runner import SimResult, simulate
from cosine_ray.sim.scenario import Scenario, ScenarioError, load, validate
from cosine_ray.sim.world import Acceptance, DrafterModel, Oracle, SimDrafter

SMALL = {
    "name": "small",
    "seed": 0,
    "engine": {"scheduler": {"max_num_seqs": 8}, "speculation": {"num_speculative_tokens": 8}},
    "latency": {"cpu": {"linear": {"c0_ms": 40, "c_req_ms": 0.5, "c_tok_ms": 0.45, "c_knee_ms": 1.5,
                                   "knee_tokens": 16, "c_attn_us": 0.2}, "source": "hand"}},
    "devices": ["cpu0"],
    "stages": [{"device": "cpu0", "latency": "cpu"}],
    "drafters": [
        {"name": "ngram", "latency": {"c0_ms": 0.1, "c_tok_ms": 0.01},
         "acceptance": {"default": {"by_depth": [0.6, 0.7, 0.7, 0.7, 0.6], "coverage": 0.6}}},
        {"name": "code", "latency": {"c0_ms": 0.2, "c_tok_ms": 0.02},
         "acceptance": {"default": {"by_depth": [0.2, 0.3]}, "code": {"by_depth": [0.7, 0.8, 0.8, 0.8]}}},
        {"name": "math", "latency": {"c0_ms": 0.2, "c_tok_ms": 0.02},
         "acceptance": {"default": {"by_depth": [0.2, 0.3]}, "math": {"by_depth": [0.7, 0.8, 0.8, 0.8]}}},
    ],
    "workload": {"num_requests": 8, "max_concurrency": 4, "domains": {"code": 1, "math": 1},
                 "input_len": 100, "output_len": 24, "range_ratio": 0.25},
}
"""The smoke scenario (deploy-style CPU stage, three drafters), 8 requests of ~24 tokens."""


def scenario(base: dict = SMALL, **changes) -> Scenario:
    """A validated deep copy of ``base`` with top-level keys replaced."""
    data = copy.deepcopy(base)
    data.update(copy.deepcopy(changes))
    validate(data)
    return Scenario(data)


def one_request(c0_ms: float = 10.0, *, output_len: int = 6, input_len: int = 20, **changes) -> dict:
    """One request on one stage whose whole cost is ``c0_ms`` a forward, no drafters."""
    data = {"name": "one", "engine": {"speculation": {"num_speculative_tokens": 0}},
            "latency": {"c": {"linear": {"c0_ms": c0_ms}}},
            "devices": ["gpu"], "stages": [{"device": "gpu", "latency": "c"}],
            "workload": {"requests": [{"input_len": input_len, "output_len": output_len}]}}
    data.update(changes)
    return data


def timings(result: SimResult) -> list[tuple]:
    return [(r.request.request_id, r.request.domain, r.request.output_len, r.start_s, r.ttft_s, r.tpot_s, r.e2e_s,
             r.accepted_length, r.verify_steps, r.routed_to) for r in result.requests]


# ---- a whole run and its summary ---------------------------------------------------------------

def test_small_scenario_runs_and_its_summary_adds_up():
    result = simulate(scenario())
    s = result.summary()
    rs = result.requests
    assert len(rs) == s["requests"] == 8
    assert {r.request.domain for r in rs} == {"code", "math"}
    lengths = [r.request.output_len for r in rs]
    assert all(18 <= n <= 30 for n in lengths) and len(set(lengths)) > 1  # range_ratio 0.25 of 24
    for r in rs:
        assert r.num_tokens == r.request.output_len
        assert 0 < r.ttft_s <= r.e2e_s
        assert r.e2e_s == pytest.approx(r.ttft_s + (r.num_tokens - 1) * r.tpot_s)
        assert r.accepted_length >= 1.0 and r.verify_steps >= 1
        assert r.start_s >= r.request.arrival_s
    assert s["output_tokens"] == sum(lengths)
    assert s["makespan_s"] == pytest.approx(max(r.start_s + r.e2e_s for r in rs)
                                            - min(r.request.arrival_s for r in rs))
    assert s["throughput_tok_s"] == pytest.approx(s["output_tokens"] / s["makespan_s"])
    assert s["ttft_mean_s"] == pytest.approx(statistics.fmean(r.ttft_s for r in rs))
    assert s["mean_accepted_length"] >= 1.0
    assert s["forwards"] >= max(r.verify_steps for r in rs) + 1
    assert sum(s["drafter_calls"].values()) > 0
    # a FIFO server cannot be busy longer than the run; the target's stage did most of the work
    assert all(0.0 <= u <= 1.0 + 1e-9 for u in s["utilisation"].values())
    assert s["utilisation"]["device:cpu0"] > 0.5
    # at most 4 requests at once (max_concurrency): the 5th starts when one of the first finishes
    starts = sorted(r.start_s for r in rs)
    assert starts[:4] == [0.0] * 4 and starts[4] > 0


def test_same_scenario_same_timings():
    first, second = simulate(scenario()), simulate(scenario())
    assert timings(first) == timings(second)
    assert first.summary()["makespan_s"] == second.summary()["makespan_s"]
    # ... and the seed matters (lengths, domains, the drafters' draws)
    assert timings(simulate(scenario(seed=1))) != timings(first)


# ---- speculation follows the acceptance model ----------------------------------------------------

def _one_drafter(alpha: float, depths: int = 6) -> list[dict]:
    return [{"name": "d", "latency": {"c0_ms": 0.1}, "acceptance": {"default": {"by_depth": [alpha] * depths}}}]


def test_speculation_speed_follows_acceptance():
    good = simulate(scenario(drafters=_one_drafter(0.9)))
    useless = simulate(scenario(drafters=_one_drafter(0.0)))
    off = simulate(scenario(engine={"scheduler": {"max_num_seqs": 8}, "speculation": {"num_speculative_tokens": 0}},
                            drafters=_one_drafter(0.9)))
    tpot = {name: r.summary()["tpot_mean_s"] for name, r in [("good", good), ("useless", useless), ("off", off)]}

    # α = 0.9 over 6 depths: ~4.8 tokens a step for little more than the cost of one
    assert tpot["good"] < 0.7 * tpot["off"], tpot
    assert statistics.fmean(r.accepted_length for r in good.requests) > 2.5
    # α = 0: the drafter is asked, nothing it says is accepted, and it cannot make decoding faster
    assert useless.drafter_calls["d"] > 0
    assert all(r.accepted_length == 1.0 for r in useless.requests)
    assert tpot["useless"] >= tpot["off"] - 1e-12
    # no speculation: the drafter is never asked
    assert off.drafter_calls["d"] == 0 and all(r.accepted_length == 1.0 for r in off.requests)


@pytest.mark.parametrize("drafters", [[], _one_drafter(0.0)], ids=["no-drafters", "alpha-0"])
def test_summary_mean_accepted_length_is_tokens_per_verify_step(drafters):
    """Every verify step without an accepted draft yields exactly one token, so the summary's
    "tokens per verify step" must be 1.0 here, like each request's own figure (the engine's
    ``RequestStats.mean_accepted_length``); the prefill's token is no verify step's."""
    result = simulate(scenario(drafters=drafters))
    assert all(r.accepted_length == 1.0 for r in result.requests)
    assert result.summary()["mean_accepted_length"] == pytest.approx(1.0)


# ---- closed forms -------------------------------------------------------------------------------

@pytest.mark.parametrize("spec", [{}, {"drafters": []}, {"engine": {"speculation": {"num_speculative_tokens": 8}},
                                                          "drafters": []}],
                         ids=["gamma-0", "gamma-0-empty-drafters", "gamma-8-no-drafters"])
def test_one_request_constant_cost_closed_form(spec):
    """One request, c0 = 10 ms a forward and nothing else, infinite links, no engine overhead:
    the prefill and every decode step take exactly 10 ms (EngineLoop's 1 ms idle sleep only runs
    after a step with no output, which never happens here)."""
    result = simulate(Scenario(one_request(10.0, **spec)))
    (r,) = result.requests
    assert r.ttft_s == pytest.approx(0.010, abs=1e-9)
    assert r.tpot_s == pytest.approx(0.010, abs=1e-9)
    assert r.e2e_s == pytest.approx(0.060, abs=1e-9)
    assert result.forwards == 6
    assert result.summary()["utilisation"]["device:gpu"] == pytest.approx(1.0)


def test_one_request_closed_form_with_every_linear_term_links_and_overhead():
    c0, c_req, c_tok, overhead, latency, n_in = 10.0, 2.0, 0.5, 0.25, 1.0, 20  # ms, ms, ms, ms, ms, tokens
    data = one_request(input_len=n_in, output_len=5,
                       latency={"c": {"linear": {"c0_ms": c0, "c_req_ms": c_req, "c_tok_ms": c_tok}}},
                       links={"engine_stage": {"latency_ms": latency}},
                       engine_host={"device": "engine", "step_overhead_ms": overhead})
    (r,) = simulate(Scenario(data)).requests
    per_forward = overhead + 2 * latency + c0 + c_req  # engine step, link there and back, fixed costs
    assert r.ttft_s * 1e3 == pytest.approx(per_forward + c_tok * n_in, abs=1e-9)
    assert r.tpot_s * 1e3 == pytest.approx(per_forward + c_tok, abs=1e-9)


def test_engine_overhead_per_request_is_charged_per_request_in_the_batch():
    """Two requests of equal lengths arrive together and share every forward: each step costs
    c0 + the engine's constant + its term per request, twice."""
    c0, overhead, per_request = 10.0, 1.0, 0.5
    data = one_request(c0, output_len=6, engine_host={"device": "engine", "step_overhead_ms": overhead,
                                                  "step_overhead_per_request_ms": per_request})
    data["workload"]["requests"] *= 2
    result = simulate(Scenario(data))
    assert result.forwards == 6
    for r in result.requests:
        assert r.ttft_s * 1e3 == pytest.approx(c0 + overhead + 2 * per_request, abs=1e-9)
        assert r.tpot_s * 1e3 == pytest.approx(c0 + overhead + 2 * per_request, abs=1e-9)


def test_logits_return_costs_a_vocab_row_on_the_engine_link():
    """One decode step with a 100 Mbps engine link: ids in (8 B a token + 64 B a header), one
    row back: 4·vocab bytes of fp32 logits or 8 bytes of id."""
    mbps, vocab = 100.0, 49152
    wire = lambda b: b * 8 / (mbps * 1e6)  # noqa: E731
    tpot = {}
    for returns in ("ids", "logits"):
        data = one_request(10.0, output_len=8, links={"engine_stage": {"bandwidth_mbps": mbps}},
                           target={"vocab_size": vocab, "returns": returns})
        (r,) = simulate(Scenario(data)).requests
        tpot[returns] = r.tpot_s
        row = 4 * vocab if returns == "logits" else 8
        assert r.tpot_s == pytest.approx(0.010 + wire(8 + 64) + wire(row), abs=1e-9)
        assert r.ttft_s == pytest.approx(0.010 + wire(8 * 20 + 64) + wire(row), abs=1e-9)
    assert tpot["logits"] > tpot["ids"] + 0.015


def test_logits_return_slows_a_speculative_run_on_a_slow_engine_link():
    slow = {"engine_stage": {"bandwidth_mbps": 100}}
    runs = {returns: simulate(scenario(links=slow, target={"vocab_size": 49152, "returns": returns}))
            for returns in ("ids", "logits")}
    ids, logits = (runs[k].summary() for k in ("ids", "logits"))
    assert logits["makespan_s"] > 1.2 * ids["makespan_s"]
    assert logits["tpot_mean_s"] > ids["tpot_mean_s"]
    # the return link is what got busier: every scored tree node ships a 196 KB row
    assert logits["utilisation"]["link:stage->engine"] > 5 * ids["utilisation"]["link:stage->engine"]


# ---- pipeline stages and lanes --------------------------------------------------------------------

PIPELINE = {
    "name": "two-stages",
    "engine": {"scheduler": {"max_num_seqs": 4, "num_lanes": 2}, "speculation": {"num_speculative_tokens": 0}},
    "latency": {"whole": {"linear": {"c0_ms": 20, "c_tok_ms": 0.1}}},
    "devices": ["gpu0", "gpu1"],
    "stages": [{"device": "gpu0", "latency": "whole", "layers": 0.5},
               {"device": "gpu1", "latency": "whole", "layers": 0.5}],
    "workload": {"requests": [{"input_len": 50, "output_len": 24}, {"input_len": 50, "output_len": 24}]},
}


def test_two_lanes_keep_both_stages_busy():
    two = simulate(scenario(PIPELINE)).summary()
    one = simulate(scenario(PIPELINE, engine={"scheduler": {"max_num_seqs": 4, "num_lanes": 1},
                                              "speculation": {"num_speculative_tokens": 0}})).summary()
    u2, u1 = two["utilisation"], one["utilisation"]
    # equal halves of the same model: both devices work the same amount
    assert u2["device:gpu0"] == pytest.approx(u2["device:gpu1"], rel=0.05)
    # one micro-batch in flight through two equal stages: each stage idles while the other works;
    # two lanes (one request each: admission fills the least loaded lane) fill the bubble
    assert u1["device:gpu0"] == pytest.approx(0.5, abs=0.05)
    assert u2["device:gpu0"] > 0.9 and u2["device:gpu1"] > 0.9
    assert two["forwards"] == 2 * one["forwards"]  # one forward per lane instead of one batched


def test_slow_stage_link_slows_the_pipeline():
    fast = simulate(scenario(PIPELINE)).summary()
    slow = simulate(scenario(PIPELINE, links={"stage_stage": {"bandwidth_mbps": 100}})).summary()
    assert slow["makespan_s"] > fast["makespan_s"]
    assert slow["tpot_mean_s"] > fast["tpot_mean_s"]
    # prefill of 50 tokens ships 50·576·4 B of hidden states: 9.2 ms at 100 Mbps, on each TTFT
    assert slow["ttft_mean_s"] - fast["ttft_mean_s"] >= 50 * 576 * 4 * 8 / 100e6 - 1e-9
    assert slow["utilisation"]["link:stage0->stage1"] > 0


# ---- the simulated drafter follows its acceptance model --------------------------------------------

def test_sim_drafter_acceptance_and_coverage_rates():
    oracle = Oracle(4096, seed=3)
    model = DrafterModel("d", {"default": Acceptance((0.7, 0.5), coverage=0.8)}, DrafterCost(0, 0, 0))
    drafter = SimDrafter(model, oracle)
    proposed = right1 = right2 = 0
    trials = 4000
    for i in range(trials):
        rid, root = f"r{i % 50}", i // 50 * 3 + 10
        chain = drafter._chain(rid, root, (), 2)
        if not chain or not chain[0]:
            continue
        proposed += 1
        if chain[0][0][0] == oracle.token(rid, root + 1):
            right1 += 1
            if len(chain) > 1 and chain[1] and chain[1][0][0] == oracle.token(rid, root + 2):
                right2 += 1
    # binomial sd <= 0.01 at these counts: 0.04 is 4 sd
    assert proposed / trials == pytest.approx(0.8, abs=0.04)
    assert right1 / proposed == pytest.approx(0.7, abs=0.04)
    assert right2 / right1 == pytest.approx(0.5, abs=0.04)


# ---- roofline ---------------------------------------------------------------------------------------

ROOFLINE = {"params_billions": 70, "bytes_per_param": 2, "memory_bandwidth_gbs": 2000, "tflops": 312,
            "bandwidth_efficiency": 0.7, "compute_efficiency": 0.5, "overhead_ms": 1.5}


def _roofline_formula(p: dict, context_lens: list[int], new_tokens: list[int]) -> float:
    """The module docstring: T = overhead + max(W/BW, 2·params·N/FLOPS) + Σ keys·kv/BW (effective)."""
    bw = p["memory_bandwidth_gbs"] * 1e9 * p["bandwidth_efficiency"]
    flops = p["tflops"] * 1e12 * p["compute_efficiency"]
    params = p["params_billions"] * 1e9
    n = sum(new_tokens)
    keys = sum(k * (l + k) for l, k in zip(context_lens, new_tokens))
    return (p["overhead_ms"] / 1e3 + max(params * p["bytes_per_param"] / bw, 2 * params * n / flops)
            + keys * p.get("kv_bytes_per_token", 0) / bw)


def test_roofline_memory_bound_at_one_token_and_compute_bound_at_many():
    cost, profile = target_cost({"roofline": ROOFLINE, "source": "datasheet"}, Path("."))
    assert profile is None and cost.source == "datasheet"
    bw, flops, params = 2000e9 * 0.7, 312e12 * 0.5, 70e9
    # one request, one new token, no context: read every weight once
    assert cost.seconds([0], [1]) == pytest.approx(1.5e-3 + 2 * params / bw, rel=1e-12)
    # far past the knee (~111 tokens here): 2·params FLOPs a token
    n = 1_000_000
    t = cost.seconds([0] * 1000, [n // 1000] * 1000)
    assert t == pytest.approx(1.5e-3 + 2 * params * n / flops, rel=1e-3)
    assert t == pytest.approx(2 * params * n / flops, rel=1e-2)
    # anywhere, the knee form equals the docstring's max(...) up to the knee's rounding (half a token)
    per_tok = 2 * params / flops
    for n in (1, 50, 110, 111, 112, 113, 200, 4096):
        assert abs(cost.seconds([0], [n]) - _roofline_formula(ROOFLINE, [0], [n])) <= 0.5 * per_tok + 1e-12, n


def test_roofline_kv_reads_and_defaults():
    spec = {"params_billions": 1, "memory_bandwidth_gbs": 100, "tflops": 10, "kv_bytes_per_token": 4096}
    cost, _ = target_cost({"roofline": spec}, Path("."))
    defaults = {"bytes_per_param": 2, "bandwidth_efficiency": 0.7, "compute_efficiency": 0.5, "overhead_ms": 0.0}
    full = {**defaults, **spec}
    for ctx, new in (([0], [1]), ([1000], [1]), ([500, 2000], [4, 1])):
        assert cost.seconds(ctx, new) == pytest.approx(_roofline_formula(full, ctx, new), rel=1e-9)
    assert cost.seconds([1000], [1]) - cost.seconds([0], [1]) == pytest.approx(1000 * 4096 / (100e9 * 0.7))


def test_a_profile_is_charged_what_it_measured_at_its_grid_points():
    """A CPU-like profile whose one-token decode is slower than a five-token one (no five-term
    fit bends that way): the simulator charges every measured sample exactly, prefills and
    decodes are corrected separately, and between grid points the charge lies between its
    neighbours' ratios times the fit."""
    samples = []
    for ctx in (64, 256):
        samples.append(LlmSample((0,), (ctx,), 2.5e-3 * ctx))
        for b in (1, 4, 8):
            for g in (0, 4, 8):
                bump = 6e-3 if g == 0 else 0.0  # the single-token kernel penalty
                samples.append(LlmSample((ctx,) * b, (1 + g,) * b, 0.035 + bump + 1.2e-3 * b * (1 + g)))
    model = LatencyModel.fit(samples)
    cost = TargetCost.from_model(model, "measured")
    for smp in samples:
        assert cost.seconds(smp.context_lens, smp.num_new_tokens) == pytest.approx(smp.seconds, rel=1e-9)
        assert abs(model.predict_llm(smp.context_lens, smp.num_new_tokens) / smp.seconds - 1) < 0.5
    one, five = cost.seconds([100], [1]), cost.seconds([100], [5])
    assert one > five  # the measured shape, which the fit alone gets backwards
    assert model.predict_llm([100], [1]) < model.predict_llm([100], [5])
    ratios = [s.seconds / model.predict_llm(s.context_lens, s.num_new_tokens) for s in samples
              if max(s.context_lens) > 0]  # the decodes'
    assert max(ratios) - min(ratios) > 0.05
    mid = cost.seconds([100, 100], [3, 3]) / model.predict_llm([100, 100], [3, 3])
    assert min(ratios) - 1e-9 <= mid <= max(ratios) + 1e-9


# ---- scenario validation -----------------------------------------------------------------------------

def _bad(path: str, value) -> dict:
    data = copy.deepcopy(SMALL)
    node = data
    keys = path.split(".")
    for k in keys[:-1]:
        node = node[int(k)] if isinstance(node, list) else node[k]
    if value is _DELETE:
        del node[keys[-1]]
    elif isinstance(node, list):
        node[int(keys[-1])] = value
    else:
        node[keys[-1]] = value
    return data


_DELETE = object()

BAD = [
    ("stages.0.device", "gpu9", r"stages\.0\.device: unknown device 'gpu9'"),
    ("stages.0.latency", "a100", r"stages\.0\.latency: unknown latency model 'a100'"),
    ("drafters.0.acceptance.default.by_depth", [0.5, 1.5], r"drafters\.0\.acceptance\.default\.by_depth\.1:"),
    ("workload.requests", [{"input_len": 10, "output_len": 4}], r"workload: give either `requests`"),
    ("stages", _DELETE, r"'stages' is a required property"),
    ("latency.cpu.linear.c0_ms", -1, r"latency\.cpu\.linear\.c0_ms:"),
    ("workload.colour", "blue", r"workload: .*'colour' was unexpected"),
    ("drafters.1.name", "ngram", r"drafters: two drafters share a name"),
    ("engine_host", {"device": "tpu"}, r"engine_host\.device: unknown device 'tpu'"),
    ("router", {"device": "engine"}, r"^'router' was renamed: use 'engine_host'$"),  # old names: one clear error
    ("links", {"router_stage": {"latency_ms": 2.0}}, r"^'links\.router_stage' was renamed: use 'links\.engine_stage'$"),
    ("links", {"router_drafter": {}}, r"^'links\.router_drafter' was renamed: use 'links\.engine_drafter'$"),
    ("devices", ["cpu0", "router"], r"^device 'router' was renamed: use 'engine'$"),
    ("drafters.0.device", "router", r"^device 'router' was renamed: use 'engine'$"),
]


@pytest.mark.parametrize("path,value,message", BAD, ids=[b[0] for b in BAD])
def test_bad_scenarios_name_their_key(tmp_path, path, value, message):
    data = _bad(path, value)
    with pytest.raises(ScenarioError, match=message):
        validate(data)
    file = tmp_path / "bad.yaml"
    file.write_text(yaml.safe_dump(data))
    with pytest.raises(ScenarioError, match=message):
        load(file)


def test_load_resolves_and_reports_the_file(tmp_path):
    file = tmp_path / "sub" / "ok.json"
    file.parent.mkdir()
    file.write_text(json.dumps(SMALL))  # JSON is YAML
    sc = load(file)
    assert sc.data == SMALL and sc.base_dir == file.parent.resolve()
    with pytest.raises(ScenarioError, match="cannot read"):
        load(tmp_path / "missing.yaml")
    (tmp_path / "broken.yaml").write_text("stages: [unclosed\n")
    with pytest.raises(ScenarioError, match="not YAML/JSON"):
        load(tmp_path / "broken.yaml")
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(ScenarioError, match="must be a mapping"):
        load(tmp_path / "list.yaml")


# ---- the CLI --------------------------------------------------------------------------------------------

def _write(tmp_path: Path, data: dict, name: str = "scenario.yaml") -> str:
    file = tmp_path / name
    file.write_text(yaml.safe_dump(data))
    return str(file)


def _one_error_line(capsys, *needles: str) -> str:
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("cosine-ray: error: "), err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


@pytest.mark.parametrize("path,value,message", BAD[:5], ids=[b[0] for b in BAD[:5]])
def test_cli_bad_scenario_file_exits_2_with_one_line(tmp_path, capsys, path, value, message):
    assert cli_main(["simulate", _write(tmp_path, _bad(path, value))]) == 2
    _one_error_line(capsys)


@pytest.mark.parametrize("assignment,needle", [
    ("stages.3.device=cpu0", "stages.3"),
    ("workload.output_len.x=1", "workload.output_len is not a mapping"),
    ("no-equals-sign", "KEY.PATH=VALUE"),
    ("workload.output_len=0", "workload.output_len"),
    ("stages.0.device=gpu9", "stages.0.device"),
    ("engine.scheduler.num_lanes=0", "num_lanes"),
    ("engine.scheduler.no_such_key=1", "no_such_key"),
    ("engine.step.num_lanes=2", "'step.num_lanes' moved: use 'scheduler.num_lanes'"),
    ("engine.model=other", "engine: model is not simulated"),
])
def test_cli_bad_set_exits_2_with_one_line(tmp_path, capsys, assignment, needle):
    assert cli_main(["simulate", _write(tmp_path, SMALL), "--set", assignment]) == 2
    _one_error_line(capsys, needle)


def test_cli_missing_file_and_no_file(tmp_path, capsys):
    assert cli_main(["simulate", str(tmp_path / "nope.yaml")]) == 2
    _one_error_line(capsys, "cannot read")
    assert cli_main(["simulate"]) == 2
    _one_error_line(capsys, "--schema")


@pytest.mark.parametrize("path,value,needle", [
    ("engine.scheduler", [1, 2], "'scheduler' must be a mapping"),
    ("engine.speculation", 5, "'speculation' must be a mapping"),
    ("workload.domains", {"code": 0}, "workload.domains"),
], ids=["part-list", "part-int", "all-domain-weights-zero"])
def test_cli_malformed_scenarios_exit_2_not_a_traceback(tmp_path, capsys, path, value, needle):
    """Schema-valid files the runner cannot use must still be one error line, not a crash."""
    assert cli_main(["simulate", _write(tmp_path, _bad(path, value))]) == 2
    _one_error_line(capsys, needle)


def test_cli_schema(capsys):
    assert cli_main(["simulate", "--schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    assert "properties" in schema and {"stages", "workload", "latency"} <= set(schema["properties"])
    assert set(schema["required"]) == {"latency", "stages", "workload"}


def test_cli_runs_a_scenario_and_writes_json(tmp_path, capsys):
    out = tmp_path / "out.json"
    rc = cli_main(["simulate", _write(tmp_path, SMALL), "--set", "workload.num_requests=5",
                   "--set", "stages.0.layers=1.0", "--fusion", "single", "--json", str(out)])
    assert rc == 0
    stdout = capsys.readouterr().out
    assert "scenario small: 5 requests" in stdout and "TPOT" in stdout
    payload = json.loads(out.read_text())
    rows = payload["requests"]
    assert len(rows) == payload["summary"]["requests"] == 5
    assert sorted(r["request_id"] for r in rows) == [f"r{i:06d}" for i in range(5)]
    assert payload["summary"]["output_tokens"] == sum(r["output_len"] for r in rows)
    assert all(r["ttft_s"] > 0 and r["e2e_s"] >= r["ttft_s"] and math.isfinite(r["tpot_s"]) for r in rows)
    # the overrides went into the scenario that ran
    assert payload["scenario"]["workload"]["num_requests"] == 5
    assert payload["scenario"]["engine"]["experiments"]["fusion"] == "single"
    assert payload["scenario"]["stages"][0]["layers"] == 1.0


def test_cli_unwritable_json_exits_2(tmp_path, capsys):
    rc = cli_main(["simulate", _write(tmp_path, SMALL), "--set", "workload.num_requests=1",
                   "--json", str(tmp_path / "no-such-dir" / "out.json")])
    assert rc == 2
    _one_error_line(capsys, "cannot write")


# ---- the shipped scenario -----------------------------------------------------------------------

def test_the_paper_testbed_scenario_loads_and_runs_lossless(tmp_path):
    """deploy/sim/paper-testbed.yaml is valid and runs through the real engine (4 stages in 4
    lanes, 16 drafter nodes on 100 Mbps): every stage works, drafters are called, and the
    experts of a request's domain get more of its routed steps than chance (4 of 16 drafters
    per domain: random routing would give them a quarter)."""
    scn = load(Path(__file__).resolve().parents[2] / "deploy" / "sim" / "paper-testbed.yaml")
    scn.data["workload"].update(num_requests=12, output_len=48, input_len=64)
    scn.data["workload"]["arrival"]["request_rate"] = 4.0
    result = simulate(scn)
    s = result.summary()
    assert s["requests"] == 12 and s["output_tokens"] == sum(r.request.output_len for r in result.requests)
    assert all(s["utilisation"][f"device:a100-{i}"] > 0 for i in range(4))
    assert sum(result.drafter_calls.values()) > 0 and s["mean_accepted_length"] > 1.0
    own = other = 0
    for r in result.requests:
        for name, steps in r.routed_to.items():
            if name.rsplit("-", 1)[0] == r.request.domain:
                own += steps
            else:
                other += steps
    assert own / (own + other) > 1.25 * 4 / 16


def test_set_null_removes_a_key(tmp_path, capsys):
    """``--set KEY=null`` deletes the key, so a scenario can switch from num_requests to duration_s."""
    data = copy.deepcopy(SMALL)
    data["workload"].update(arrival={"request_rate": 4.0})
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(data))
    out = tmp_path / "o.json"
    rc = cli_main(["simulate", str(path), "--set", "workload.num_requests=null", "--set", "workload.duration_s=2",
                   "--json", str(out)])
    assert rc == 0, capsys.readouterr().err
    rows = json.loads(out.read_text())["requests"]
    assert rows and all(r["arrival_s"] < 2.0 for r in rows)
