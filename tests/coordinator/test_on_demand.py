"""Models loaded on request, in the real coordinator with fake workers and a fake supervisor
(what `tandem serve` does on the channel, done in-process): one start per model however many
first requests wait, the least recently used idle model unloaded for room, a model with a
request in flight never, a budget that cannot be met refused, a worker that exits while its
model loads failing the load at once, keep_alive 0 stopping the workers; and the pieces
(ModelBudget, parse_size, the launcher's worker names) on their own."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from common.errors import ModelNotFoundError
from common.model_files import load_config
from common.model_identity import model_fingerprint
from common.model_store import ModelStore
from common.supervisor_wire import WorkerExit
from coordinator.model import load_served_model
from coordinator.model_budget import Loaded, ModelBudget, ModelBudgetExceeded, parse_size
from coordinator.on_demand import ModelLoadError, OnDemandModels, canonical_name
from reliability.model_factory import make_tiny_gguf
from tests.helpers.coordinator_fakes import Script, coordinator_harness, make_tiny_model_dir, run
from tests.helpers.foreign_stores import make_ollama_store


class FakeSupervisor:
    """Starts a fake decode worker per model (registering like a real one); `failing`
    models' workers 'exit' instead."""

    def __init__(self, harness, failing: frozenset[str] = frozenset()) -> None:
        self.harness, self.failing = harness, failing
        self.started: list[str] = []
        self.stopped: list[str] = []
        self.workers: dict[str, object] = {}

    async def open(self) -> None:
        pass

    async def close(self) -> None:
        pass

    async def start(self, model: str, path: Path) -> list[str]:
        self.started.append(model)
        worker_id = f"{model}-decode-0"
        if model not in self.failing:
            fingerprint = model_fingerprint(path, load_config(path))
            self.workers[model] = await self.harness.add_worker(worker_id, "decode", Script(),
                                                                fingerprint=fingerprint)
        return [worker_id]

    async def exits(self, model: str) -> list[WorkerExit]:
        return [WorkerExit(f"{model}-decode-0", 1, "RuntimeError: no memory")] if (
            model in self.failing) else []

    async def stop(self, model: str) -> list[str]:
        self.stopped.append(model)
        worker = self.workers.pop(model, None)
        if worker is not None:
            await worker.stop()
        return [f"{model}-decode-0 (exit 0)"]


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    root = tmp_path_factory.mktemp("ondemand")
    ollama = root / "ollama"
    sizes = {}
    for seed, name in enumerate(("alpha", "beta", "gamma"), start=1):
        gguf = make_tiny_gguf(root / f"{name}.gguf", seed=seed).path
        make_ollama_store(ollama, gguf, name=f"library/{name}", params={}, system=None)
        sizes[name] = gguf.stat().st_size
    pinned = load_served_model(make_tiny_model_dir(root / "pinned"), "pinned")
    return pinned, ModelStore(root / "home", ollama_models=ollama), sizes


def _on_demand(h, store, budget: ModelBudget, failing=frozenset()):
    supervisor = FakeSupervisor(h, failing)
    h.coordinator.on_demand = OnDemandModels(h.coordinator, supervisor, budget, store,
                                             start_timeout_s=30.0, poll_s=0.05)
    return h.coordinator.on_demand, supervisor


def _listed(h) -> list[str]:
    return [m.name for m in h.coordinator.models]


def test_first_requests_load_once_and_the_least_recently_used_idle_model_makes_room(stores):
    pinned, store, _ = stores

    async def main() -> None:
        async with coordinator_harness(pinned) as h:
            od, sup = _on_demand(h, store, ModelBudget(max_models=3))
            c = h.coordinator
            a, a2 = await asyncio.gather(c.find_model("alpha"), c.find_model("alpha:latest"))
            assert a is a2 and a.name == "alpha" and sup.started == ["alpha"]
            assert _listed(h) == ["pinned", "alpha"]
            b = await c.find_model("library/beta")
            assert b.name == "beta" and _listed(h) == ["pinned", "alpha", "beta"]
            # alpha used after beta: beta is now the least recently used of the idle two.
            pool = c.pools[a.fingerprint]
            await pool.residency.acquire()
            pool.residency.release(None)
            await c.find_model("gamma")
            assert sup.stopped == ["beta"] and _listed(h) == ["pinned", "alpha", "gamma"]
            assert b.fingerprint not in c.pools
            assert not any(w.model_fingerprint == b.fingerprint for w in c.registry.all())
            assert od.loaded() == ["alpha", "gamma"]

    run(main())


def test_a_model_in_use_is_never_unloaded_for_room_and_the_refusal_names_the_budget(stores):
    pinned, store, sizes = stores

    async def main() -> None:
        async with coordinator_harness(pinned) as h:
            od, sup = _on_demand(h, store, ModelBudget(max_models=2))
            c = h.coordinator
            alpha = await c.find_model("alpha")
            residency = c.pools[alpha.fingerprint].residency
            await residency.acquire()  # a request in flight on alpha
            with pytest.raises(ModelBudgetExceeded, match=r"at most 2 model\(s\).*alpha"):
                await c.find_model("beta")
            assert sup.started == ["alpha"] and sup.stopped == [] and "alpha" in _listed(h)
            residency.release(None)
            await c.find_model("beta")
            assert sup.stopped == ["alpha"] and _listed(h) == ["pinned", "beta"]

    run(main())


def test_a_worker_that_exits_fails_its_load_and_leaves_nothing_behind(stores):
    pinned, store, _ = stores

    async def main() -> None:
        async with coordinator_harness(pinned) as h:
            od, sup = _on_demand(h, store, ModelBudget(max_models=2), failing=frozenset({"alpha"}))
            c = h.coordinator
            with pytest.raises(ModelLoadError, match=r"(?s)alpha-decode-0 exited with code 1.*no memory"):
                await c.find_model("alpha")
            assert sup.stopped == ["alpha"] and _listed(h) == ["pinned"]
            assert len(c.pools) == 1
            await c.find_model("beta")  # its reservation is gone: beta fits beside pinned
            assert _listed(h) == ["pinned", "beta"] and sup.stopped == ["alpha"]

    run(main())


def test_keep_alive_zero_stops_the_workers_and_a_later_request_loads_it_again(stores):
    pinned, store, _ = stores

    async def main() -> None:
        async with coordinator_harness(pinned) as h:
            od, sup = _on_demand(h, store, ModelBudget())
            c = h.coordinator
            alpha = await c.find_model("alpha")
            await c.preload(0, alpha)
            for _ in range(100):  # the stop runs as its own task
                if sup.stopped:
                    break
                await asyncio.sleep(0.05)
            assert sup.stopped == ["alpha"] and _listed(h) == ["pinned"]
            await od.close()  # every stop done: the registry forgot alpha's worker
            assert not c.registry.all(alpha.fingerprint)
            again = await c.find_model("alpha")
            assert again.fingerprint == alpha.fingerprint and sup.started == ["alpha", "alpha"]

    run(main())


def test_the_listings_and_show_read_the_stores_models_without_loading_them(stores):
    """As Ollama lists and shows every model of its store: /api/tags and /v1/models list the
    models the stores hold beside the served one, /api/show and /v1/models/NAME describe one
    that is not loaded, and none of it starts a worker; a loaded model is listed once."""
    import ollama
    import openai

    pinned, store, sizes = stores

    async def main() -> None:
        async with coordinator_harness(pinned) as h:
            _, sup = _on_demand(h, store, ModelBudget())
            client = ollama.AsyncClient(host=h.url)
            oai = openai.AsyncOpenAI(base_url=h.url + "/v1", api_key="x", max_retries=0)
            everything = ["pinned:latest", "alpha:latest", "beta:latest", "gamma:latest"]
            tags = (await client.list()).models
            assert [m.model for m in tags] == everything
            assert {m.model: m.size for m in tags[1:]} == {f"{n}:latest": s
                                                          for n, s in sizes.items()}
            assert all(m.details.format == "gguf" for m in tags[1:])
            assert [m.id for m in (await oai.models.list()).data] == everything
            shown = await client.show("beta")
            assert shown.modelinfo["general.architecture"] == "llama"
            assert shown.details.family == "llama" and "<|im_start|>" in shown.template
            assert (await oai.models.retrieve("gamma:latest")).id == "gamma:latest"
            assert sup.started == [] and _listed(h) == ["pinned"]  # nothing was loaded

            await h.coordinator.find_model("alpha")
            assert [m.model for m in (await client.list()).models] == [
                "pinned:latest", "alpha:latest", "beta:latest", "gamma:latest"]
            assert sup.started == ["alpha"]
            with pytest.raises(ollama.ResponseError) as missing:
                await client.show("delta")
            assert missing.value.status_code == 404
            with pytest.raises(openai.NotFoundError):
                await oai.models.retrieve("delta")

    run(main())


def test_a_store_model_that_cannot_be_read_is_left_out_of_the_listing_and_not_shown(stores,
                                                                                   tmp_path):
    """A manifest whose model blob is gone (an interrupted `ollama rm`): /api/tags lists the
    models that can be read, without it, and /api/show of it is a 404; nothing is started."""
    import json

    import ollama

    pinned, _, _ = stores
    root = tmp_path / "ollama"
    make_ollama_store(root, make_tiny_gguf(tmp_path / "ok.gguf", seed=5).path, name="library/ok",
                      params={}, system=None)
    make_ollama_store(root, make_tiny_gguf(tmp_path / "gone.gguf", seed=6).path,
                      name="library/gone", params={}, system=None)
    manifest = root / "manifests" / "registry.ollama.ai" / "library" / "gone" / "latest"
    model_layer = next(layer for layer in json.loads(manifest.read_text())["layers"]
                       if layer["mediaType"].endswith(".model"))
    (root / "blobs" / model_layer["digest"].replace(":", "-")).unlink()
    store = ModelStore(tmp_path / "home", ollama_models=root)

    async def main() -> None:
        async with coordinator_harness(pinned) as h:
            _, sup = _on_demand(h, store, ModelBudget())
            client = ollama.AsyncClient(host=h.url)
            assert [m.model for m in (await client.list()).models] == ["pinned:latest", "ok:latest"]
            with pytest.raises(ollama.ResponseError) as missing:
                await client.show("gone")
            assert missing.value.status_code == 404
            assert sup.started == []

    run(main())


def test_a_template_given_for_a_store_model_is_what_it_renders_loaded_or_not(stores, tmp_path):
    """--chat-template-for beta=FILE: beta, not served at start, renders FILE when a request
    loads it, and /api/show shows FILE's template before that; other models keep their own."""
    import ollama

    from common.model_name import name_key

    pinned, store, _ = stores
    template = tmp_path / "plain.jinja"
    template.write_text("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}"
                        "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")

    async def main() -> None:
        async with coordinator_harness(pinned) as h:
            supervisor = FakeSupervisor(h)
            h.coordinator.on_demand = OnDemandModels(
                h.coordinator, supervisor, ModelBudget(), store, start_timeout_s=30.0,
                poll_s=0.05, templates={name_key("beta"): str(template)})
            client = ollama.AsyncClient(host=h.url)
            assert (await client.show("beta:latest")).template == template.read_text()
            assert "<|im_start|>" in (await client.show("alpha")).template
            assert supervisor.started == []
            beta = await h.coordinator.find_model("library/beta")
            assert beta.tokenizer.chat_template == template.read_text()
            alpha = await h.coordinator.find_model("alpha")
            assert alpha.tokenizer.chat_template != template.read_text()

    run(main())


def test_names_no_store_holds_and_paths_are_not_found(stores, tmp_path):
    pinned, store, _ = stores
    path = make_tiny_gguf(tmp_path / "here.gguf").path

    async def main() -> None:
        async with coordinator_harness(pinned) as h:
            _, sup = _on_demand(h, store, ModelBudget())
            for name in ("delta", str(path)):
                with pytest.raises(ModelNotFoundError, match="not found"):
                    await h.coordinator.find_model(name)
            assert sup.started == []

    run(main())


def test_the_budget_unloads_least_recently_used_idle_models_until_one_fits():
    def m(key, size, used, evictable=True):
        return Loaded(key, key, size, used, evictable)

    budget = ModelBudget(max_bytes=100)
    loaded = [m("pinned", 30, 0, evictable=False), m("a", 30, 5), m("b", 30, 1)]
    assert budget.to_unload("new", 10, loaded) == []
    assert [v.key for v in budget.to_unload("new", 40, loaded)] == ["b"]
    assert [v.key for v in budget.to_unload("new", 70, loaded)] == ["b", "a"]
    with pytest.raises(ModelBudgetExceeded, match="beside .*pinned"):
        budget.to_unload("new", 71, loaded)
    with pytest.raises(ModelBudgetExceeded, match="larger than the model memory budget"):
        budget.to_unload("new", 101, loaded)
    busy = [m("pinned", 30, 0, evictable=False), m("a", 30, 5, evictable=False)]
    with pytest.raises(ModelBudgetExceeded):
        budget.to_unload("new", 50, busy)
    assert [v.key for v in ModelBudget(max_models=2).to_unload("n", 1, loaded)] == ["b", "a"]


def test_sizes_and_canonical_names():
    assert parse_size("8GB") == 8 * 10**9 and parse_size("512MiB") == 512 * 2**20
    assert parse_size("1.5g") == 1_500_000_000 and parse_size("1234") == 1234
    for bad in ("lots", "0", "-5GB", "8 parsecs"):
        with pytest.raises(ValueError):
            parse_size(bad)
    assert canonical_name("registry.ollama.ai/library/beta:latest") == "beta"
    assert canonical_name("qwen3:0.6b") == "qwen3:0.6b"
    assert canonical_name("org/model:Q4_K_M") == "org/model:Q4_K_M"


def test_the_launcher_names_a_model_s_workers_apart_from_the_running_ones(tmp_path):
    from deploy.local_topology import Topology
    from deploy.model_supervisor import ModelSupervisor

    class Cluster:
        children_lock = __import__("threading").RLock()
        children = []

    topology = Topology(model="a", model_path=tmp_path, log_dir=tmp_path, prefill=1, decode=2,
                        load_on_request=True)
    supervisor = ModelSupervisor(topology, 5555)
    supervisor.cluster = Cluster()
    specs = supervisor.specs("qwen3:0.6b", tmp_path)
    assert [s.name for s in specs] == ["qwen3-0-6b-prefill-0", "qwen3-0-6b-decode-0",
                                       "qwen3-0-6b-decode-1"]
    assert all("--coordinator" in s.argv and "127.0.0.1:5555" in s.argv for s in specs)

    class Running:
        def __init__(self, name):
            self.spec = type("S", (), {"name": name})

    Cluster.children = [Running("qwen3-0-6b-decode-0")]  # another model with this slug
    assert [s.name for s in supervisor.specs("qwen3-0.6b", tmp_path)][0] == "qwen3-0-6b-2-prefill-0"


def test_worker_counts_given_for_a_model_loaded_on_request_are_its_own(tmp_path):
    """--workers MODEL=P:D with --load-on-request: MODEL may be a store's model no --model
    names; a request that loads it by any spelling gets those counts, others the defaults."""
    from deploy.local_topology import Topology
    from deploy.model_supervisor import ModelSupervisor

    class Cluster:
        children_lock = __import__("threading").RLock()
        children = []

    def roles(topology, model):
        supervisor = ModelSupervisor(topology, 5555)
        supervisor.cluster = Cluster()
        return [s.name.rsplit("-", 2)[-2] for s in supervisor.specs(model, tmp_path)]

    topology = Topology(model="a", model_path=tmp_path, log_dir=tmp_path, prefill=1, decode=1,
                        load_on_request=True, model_workers=(("qwen3:0.6b", 2, 3),
                                                             ("library/beta", 0, 2)))
    assert roles(topology, "qwen3:0.6b") == ["prefill"] * 2 + ["decode"] * 3
    assert roles(topology, "beta") == roles(topology, "beta:latest") == ["decode"] * 2
    assert roles(topology, "gamma") == ["prefill", "decode"]  # the --prefill/--decode counts
    with pytest.raises(ValueError, match="not a served model.*load_on_request"):
        Topology(model="a", model_path=tmp_path, log_dir=tmp_path,
                 model_workers=(("qwen3:0.6b", 2, 3),))
    with pytest.raises(ValueError, match="decode worker of 'beta'"):
        Topology(model="a", model_path=tmp_path, log_dir=tmp_path, load_on_request=True,
                 model_workers=(("beta", 1, 0),))
    with pytest.raises(ValueError, match="given twice"):
        Topology(model="a", model_path=tmp_path, log_dir=tmp_path, load_on_request=True,
                 model_workers=(("beta", 1, 1), ("beta:latest", 1, 2)))
