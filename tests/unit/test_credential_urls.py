"""Where a credential may go: ``hub.endpoint`` only to the public Hub, ``HF_ENDPOINT`` or a base URL
the operator lists in NEURON_FLOWS_ALLOWED_HUB_ENDPOINTS (compared as the server they reach), and
the failure webhook only over https (http to this machine), never shown whole in a refusal."""

from __future__ import annotations

import pytest

from neuron_flows.flows.notify import WEBHOOK_ENV, sync_failure_notifications, webhook_url
from neuron_flows.tasks.config import ALLOWED_HUB_ENDPOINTS_ENV, FinetuneConfig
from neuron_parallel.urls import base_url, encrypted_or_local, redact_url

SECRET = "T0KEN/B1234/xyzSECRETxyz"


def _endpoint(value: str) -> str | None:
    return FinetuneConfig.load(None, [f"hub.endpoint={value}"]).hub.endpoint


def _refusal(value: str) -> str:
    with pytest.raises(ValueError) as e:
        _endpoint(value)
    message = str(e.value)
    assert "\n" not in message and message.startswith("invalid config: hub.endpoint: "), message
    return message


def test_base_urls_compare_as_the_server_they_reach():
    same = [
        "https://hub.example.org",
        "HTTPS://Hub.Example.ORG/",
        "https://hub.example.org:443",
        " https://hub.example.org// ",
    ]
    assert {base_url(u) for u in same} == {"https://hub.example.org"}
    assert base_url("http://127.0.0.1:80/") == "http://127.0.0.1"
    assert base_url("http://[::1]:8080") == "http://[::1]:8080"
    assert base_url("https://hub.example.org/mirror/") == "https://hub.example.org/mirror"
    assert len({base_url(u) for u in ("https://h.org:8443", "http://h.org", "https://h.org", "https://h.org/x")}) == 4
    for bad in (
        "hub.example.org",
        "ftp://hub.example.org",
        "https://",
        "https://h.org:99999",
        "https://u:p@h.org",
        "https://h.org/?token=x",
        "https://h.org/#x",
    ):
        with pytest.raises(ValueError):
            base_url(bad)


def test_only_tls_or_this_machine_carries_a_credential():
    assert encrypted_or_local("https://hooks.example.com/x")
    assert all(encrypted_or_local(f"http://{host}:9/x") for host in ("127.0.0.1", "localhost", "[::1]"))
    for bad in ("http://hooks.example.com/x", "http://127.0.0.2/x", "http://localhost.evil.example/x", "hooks", ""):
        assert not encrypted_or_local(bad), bad


def test_a_redacted_url_keeps_scheme_and_host_only():
    assert redact_url(f"https://user:pw@Hooks.Slack.com/services/{SECRET}?a=b") == "https://hooks.slack.com/…"
    assert redact_url("http://127.0.0.1:8080/") == "http://127.0.0.1:8080"
    assert redact_url(f"hooks.slack.com/{SECRET}") == "…" and redact_url("https://h.org:bad/x") == "…"


def test_the_public_hub_and_hf_endpoint_are_allowed_by_default(monkeypatch):
    monkeypatch.delenv(ALLOWED_HUB_ENDPOINTS_ENV, raising=False)
    monkeypatch.delenv("HF_ENDPOINT", raising=False)
    assert _endpoint("https://huggingface.co/") == "https://huggingface.co/"
    assert FinetuneConfig.load(None).hub.endpoint is None  # unset: huggingface_hub's own default
    _refusal("https://hub.example.org")
    monkeypatch.setenv("HF_ENDPOINT", "https://hub.example.org")
    assert _endpoint("https://Hub.example.org:443")


def test_an_endpoint_is_allowed_only_when_the_operator_lists_it(monkeypatch):
    monkeypatch.delenv("HF_ENDPOINT", raising=False)
    monkeypatch.setenv(ALLOWED_HUB_ENDPOINTS_ENV, " HTTPS://Hub.Example.org:443/ , http://127.0.0.1:8080")
    for value in ("https://hub.example.org", "https://hub.example.org/", "http://127.0.0.1:8080/"):
        assert _endpoint(value) == value
    message = _refusal("https://evil.example")
    assert "'https://evil.example' is not a Hub endpoint this machine allows" in message
    assert f"adds https://evil.example to {ALLOWED_HUB_ENDPOINTS_ENV}" in message and "or unset hub.endpoint" in message
    # Loopback: only the listed host and port; another spelling of this machine is another endpoint.
    for value in (
        "http://127.0.0.1:8081",
        "http://localhost:8080",
        "http://[::1]:8080",
        "https://hub.example.org:8443",
    ):
        assert ALLOWED_HUB_ENDPOINTS_ENV in _refusal(value), value


def test_what_no_list_can_allow_and_a_malformed_list(monkeypatch):
    monkeypatch.setenv(ALLOWED_HUB_ENDPOINTS_ENV, "http://hub.example.org,https://u:p@h.org")
    assert "is not an https:// URL" in _refusal("http://hub.example.org")  # listed, but the token would travel bare
    message = _refusal("https://u:p@h.org")
    assert "'https://h.org' is not a base URL: it carries user info" in message and "u:p" not in message
    monkeypatch.setenv(ALLOWED_HUB_ENDPOINTS_ENV, "https://ok.example.org,hub.example.org")
    message = _refusal("https://ok.example.org")
    assert f"${ALLOWED_HUB_ENDPOINTS_ENV}: 'hub.example.org' is not an http:// or https:// URL" in message
    assert "separated by commas, e.g. https://hub.example.org" in message


@pytest.mark.parametrize("url", [f"http://hooks.example.com/{SECRET}", f"hooks.example.com/{SECRET}"])
def test_a_webhook_without_tls_is_refused_without_showing_its_url(monkeypatch, url):
    monkeypatch.setenv(WEBHOOK_ENV, url)
    with pytest.raises(ValueError) as e:
        webhook_url()
    message = str(e.value)
    assert message.startswith(f"{WEBHOOK_ENV}=") and "https://" in message and f"or unset {WEBHOOK_ENV}" in message
    assert "SECRET" not in message and "\n" not in message, message
    import asyncio

    with pytest.raises(ValueError, match=WEBHOOK_ENV):  # refused before the Prefect API is asked anything
        asyncio.run(sync_failure_notifications(["finetune"], webhook=url))


def test_a_webhook_over_tls_or_to_this_machine_is_taken(monkeypatch):
    monkeypatch.setenv(WEBHOOK_ENV, f" https://hooks.example.com/{SECRET} ")
    assert webhook_url() == f"https://hooks.example.com/{SECRET}"
    assert webhook_url(f"http://127.0.0.1:9/{SECRET}") == f"http://127.0.0.1:9/{SECRET}"
    monkeypatch.setenv(WEBHOOK_ENV, "  ")
    assert webhook_url() is None
