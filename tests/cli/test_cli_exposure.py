"""``cosine-ray serve`` is closed by default: a host beyond this machine without an API key is
refused before anything starts (one line, exit 2), unless ``--allow-unauthenticated`` (or the
file's ``allow_unauthenticated: true``); on localhost a keyless server tells the application
builder it may run open, since the builder cannot see the host and refuses otherwise."""

from __future__ import annotations

import pytest
import yaml

from cosine_ray.cli import CliError, build_parser, main
from cosine_ray.cli.serve import _ingress_args, check_exposure, is_loopback


def ingress(*argv: str) -> dict:
    return _ingress_args(build_parser().parse_args(["serve", *argv]), None)


@pytest.fixture(autouse=True)
def _no_env_key(monkeypatch):
    monkeypatch.delenv("COSINE_RAY_API_KEY", raising=False)


@pytest.mark.parametrize("host, local", [
    ("127.0.0.1", True), ("127.0.0.2", True), ("localhost", True), ("::1", True), ("[::1]", True),
    ("0.0.0.0", False), ("::", False), ("192.168.1.5", False), ("my-host.example", False),
])
def test_what_counts_as_this_machine(host, local):
    assert is_loopback(host) is local


def test_a_public_host_without_a_key_is_refused_with_the_ways_out():
    with pytest.raises(CliError) as info:
        check_exposure("0.0.0.0", ingress())
    message = str(info.value)
    assert "\n" not in message
    for needed in ("--host 0.0.0.0", "--api-key", "COSINE_RAY_API_KEY", "--allow-unauthenticated"):
        assert needed in message, message


def test_a_key_or_the_flag_opens_it_and_localhost_tells_the_builder(monkeypatch):
    assert check_exposure("0.0.0.0", ingress("--api-key", "k")) == {"api_key": "k"}
    assert check_exposure("0.0.0.0", ingress("--allow-unauthenticated")) == {"allow_unauthenticated": True}
    assert check_exposure("127.0.0.1", ingress()) == {"allow_unauthenticated": True}
    assert check_exposure("127.0.0.1", ingress("--api-key", "k")) == {"api_key": "k"}
    monkeypatch.setenv("COSINE_RAY_API_KEY", "env")
    assert check_exposure("10.1.2.3", ingress()) == {"api_key": "env"}


def test_the_builder_refuses_to_run_open_unless_told(monkeypatch):
    """``serve run``/``serve deploy`` of a Serve config reach ``build_app`` with no CLI in
    front: no key (args or COSINE_RAY_API_KEY) and no ``allow_unauthenticated`` is a ValueError;
    the key it saw is the one the ingress gets."""
    from cosine_ray.serve.app import build_app

    with pytest.raises(ValueError, match="^no API key: set COSINE_RAY_API_KEY .* allow_unauthenticated: true"):
        build_app({"num_stages": 1})
    with pytest.raises(ValueError, match="^no API key"):
        build_app({"num_stages": 1, "allow_unauthenticated": "yes"})
    assert ingress_kwargs(build_app({"num_stages": 1, "allow_unauthenticated": True})) == {}
    assert ingress_kwargs(build_app({"num_stages": 1, "api_key": "arg-key"})) == {"api_key": "arg-key"}
    monkeypatch.setenv("COSINE_RAY_API_KEY", "env-key")
    assert ingress_kwargs(build_app({"num_stages": 1})) == {"api_key": "env-key"}


def ingress_kwargs(app) -> dict:
    """The keyword arguments the ingress deployment is bound with (Serve's Application)."""
    return dict(app._bound_deployment.init_kwargs)


@pytest.mark.real_model
def test_serve_on_a_public_host_without_a_key_exits_2_before_ray_starts(tmp_path, capsys, real_checkpoint):
    assert main(["serve", "--host", "0.0.0.0", "--drafters", "ngram"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("cosine-ray: error: --host 0.0.0.0 serves beyond this machine"), err
    config = tmp_path / "serve.yaml"
    config.write_text(yaml.safe_dump({"http_options": {"host": "0.0.0.0"}, "applications": [
        {"name": "cosine_ray", "import_path": "cosine_ray.serve.app:build_app", "args": {"drafters": "ngram"}}]}))
    assert main(["serve", "--config", str(config)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--allow-unauthenticated" in err[0], err


def test_a_key_file_counts_as_a_key(tmp_path, monkeypatch):
    """Several keys (``--api-key-file``, ``api_keys``) close the server as one key does."""
    from cosine_ray.serve.app import build_app

    keys = tmp_path / "keys"
    keys.write_text("secret-one name=alice\nsecret-two name=bob\n")
    served = check_exposure("0.0.0.0", ingress("--api-key-file", str(keys)))
    assert [k["name"] for k in served["api_keys"]] == ["alice", "bob"] and "allow_unauthenticated" not in served
    assert "api_keys" in ingress_kwargs(build_app({"num_stages": 1, "api_key_file": str(keys)}))
    monkeypatch.setenv("COSINE_RAY_API_KEY_FILE", str(keys))
    assert "allow_unauthenticated" not in ingress_kwargs(build_app({"num_stages": 1}))
