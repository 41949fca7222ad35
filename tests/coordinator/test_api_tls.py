"""TLS of the client APIs (coordinator/api_tls.py): a coordinator started with --api-tls-cert
and --api-tls-key answers the real `ollama` and `openai` clients over HTTPS and the gRPC client
over TLS, given the CA; plaintext and untrusting clients are refused; bad files are start-up
errors that name the file and the flag."""

from __future__ import annotations

import asyncio
import ssl

import grpc
import httpx
import ollama
import openai
import pytest

from coordinator.api_tls import ApiTLS, api_tls_from
from coordinator.client import TandemClient
from deploy.remote import Server
from common.errors import TandemError
from tests.helpers.coordinator_fakes import Script, coordinator_harness, load_model, make_tiny_model_dir, run
from tests.helpers.tls_certs import issue, make_ca

TEXT = "Hello world! How are you?"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(make_tiny_model_dir(tmp_path_factory.mktemp("tiny")))


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("certs")
    ca = make_ca(folder / "ca")
    return issue(folder, ca, "api"), issue(folder, ca, "other")


def test_bad_api_tls_files_are_start_up_errors_naming_them(tmp_path, certs):
    api, other = certs
    with pytest.raises(ValueError, match="--api-tls-key missing"):
        api_tls_from(str(api.cert), None)
    with pytest.raises(ValueError, match=r"nope.pem \(--api-tls-cert\) does not exist"):
        api_tls_from(str(tmp_path / "nope.pem"), str(api.key))
    with pytest.raises(ValueError, match=r"\(--api-tls-key\) holds no PEM private key"):
        ApiTLS(api.cert, api.cert)
    with pytest.raises(ValueError, match="is not the key of the certificate"):
        ApiTLS(api.cert, other.key)
    assert api_tls_from(None, None) is None  # the default: plaintext, as before
    assert api_tls_from(str(api.cert), str(api.key)).key == api.key


def test_clients_reach_a_tls_coordinator_with_the_ca_and_plaintext_is_refused(model, certs):
    api, _ = certs
    tokens = model.tokenizer.encode(TEXT, add_special_tokens=False)
    trust = ssl.create_default_context(cafile=str(api.ca))
    messages = [{"role": "user", "content": "Hi"}]

    def grpc_calls(target: str) -> tuple:
        with TandemClient(target, timeout_s=30, ca_file=str(api.ca)) as client:
            names = [m.name for m in client.list_models()]
            text = client.chat_text("tiny", messages)
        with TandemClient(target, timeout_s=5) as plain:
            with pytest.raises(grpc.RpcError) as refused:
                plain.list_models()
        return names, text, refused.value.code()

    def cli_calls(url: str) -> tuple:
        from deploy.local import LocalCluster
        from deploy.process_plan import Readiness

        trusted = Server(url, timeout_s=30, ca_file=str(api.ca))
        names = [m["name"] for m in trusted.tags()]
        with pytest.raises(TandemError, match="not trusted.*--ca-file"):
            Server(url, timeout_s=30).running()  # the system's CAs do not know ours
        live, ids = LocalCluster([], Readiness(url, {}))._live_workers()  # `tandem serve`'s poll
        return names, live["decode"], ids

    async def scenario():
        async with coordinator_harness(model, api_tls=ApiTLS(api.cert, api.key),
                                       prefill_threshold=100_000) as h:
            await h.add_worker("d1", "decode", Script(tokens=tokens))
            assert h.url.startswith("https://")
            reply = await ollama.AsyncClient(host=h.url, verify=trust, timeout=30).chat(
                model="tiny", messages=messages)
            assert reply.message.content == TEXT
            async with httpx.AsyncClient(verify=trust) as http:
                oai = openai.AsyncOpenAI(base_url=h.url + "/v1", api_key="unused",
                                         http_client=http, max_retries=0)
                assert [m.id for m in (await oai.models.list()).data] == ["tiny:latest"]
            plain_url = h.url.replace("https://", "http://")
            async with httpx.AsyncClient(timeout=10) as plain:
                with pytest.raises(httpx.HTTPError):
                    await plain.get(plain_url + "/api/tags")
            async with httpx.AsyncClient(timeout=10) as untrusting:
                with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
                    await untrusting.get(h.url + "/api/tags")
            target = f"127.0.0.1:{h.coordinator.grpc_port}"
            return (await asyncio.to_thread(grpc_calls, target),
                    await asyncio.to_thread(cli_calls, h.url))

    (names, text, refused), cli_names = run(scenario())
    assert names == ["tiny:latest"] and text == TEXT
    assert refused is grpc.StatusCode.UNAVAILABLE
    assert cli_names == (["tiny:latest"], 1, {"d1"})


def test_tandem_serve_hands_the_coordinator_its_tls_and_polls_it_over_https(tmp_path, monkeypatch,
                                                                          certs):
    import cli.main
    import deploy.local

    api, other = certs
    model_dir = make_tiny_model_dir(tmp_path / "tiny")
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path / "h"))
    seen = {}
    monkeypatch.setattr(deploy.local, "serve", lambda topology, **kw: seen.setdefault("t", topology) and 0)
    base = ["serve", "--model", str(model_dir), "--log-dir", str(tmp_path / "logs")]
    assert cli.main.main([*base, "--api-tls-cert", str(api.cert), "--api-tls-key", str(api.key)]) == 0
    specs, ready = deploy.process_plan.plan(seen["t"])
    coordinator = specs[0].argv
    assert coordinator[coordinator.index("--api-tls-cert") + 1] == str(api.cert)
    assert coordinator[coordinator.index("--api-tls-key") + 1] == str(api.key)
    assert not any("--api-tls" in a for s in specs[1:] for a in s.argv)  # workers serve no client
    assert ready.url.startswith("https://")
    # A mismatched key: refused before anything starts, in one line.
    assert cli.main.main([*base, "--api-tls-cert", str(api.cert), "--api-tls-key", str(other.key)]) == 1
    assert not (tmp_path / "logs").exists()
