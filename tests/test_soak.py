"""``vismemo bench soak`` in small: two processes on one shared directory and a local 3-master Redis Cluster, every
fault class injected at least once while they serve; no exception, misses and exact hits equal to plain
transformers, and no entry ``flush()`` acknowledged is lost while its tier is up."""

import json
import shutil

import pytest

from conftest import REDIS_SERVER

pytest.importorskip("redis", reason="the redis client is not installed (pip install -e '.[test]')")
pytestmark = pytest.mark.skipif(REDIS_SERVER is None or shutil.which("redis-cli") is None,
                                reason="redis-server / redis-cli not installed (apt-get install redis-server)")


def test_a_small_soak_injects_every_fault_and_loses_nothing(tmp_path):
    from vismemo_hf.bench.soak import FAULTS
    from vismemo_hf.cli import main

    args = ["bench", "soak", "--processes", "2", "--requests", "40", "--kills", "2", "--node-kills", "1",
            "--disk-full", "1", "--redis-full", "1", "--blob-faults", "1", "--db-faults", "1", "--pace-ms", "500",
            "--node-down-s", "1", "--fault-s", "1", "--arm-timeout", "8", "--baseline-alongside", "--quiet",
            "--out", str(tmp_path)]
    code = main(args)
    r = json.loads((tmp_path / "soak.json").read_text())
    assert (tmp_path / "soak.md").read_text().startswith("# Soak") and (tmp_path / "soak.png").stat().st_size > 0
    assert r["served"] == 40 and r["exceptions"] == 0 and r["crashes"] == 0, r["exception_samples"]
    assert r["kinds"]["soak"]["miss"]["differ"] == 0 and r["kinds"]["soak"]["exact"]["differ"] == 0
    assert r["kinds"]["soak"]["miss"]["n"] and r["kinds"]["soak"]["exact"]["n"] and r["kinds"]["soak"]["approximate"]["n"]
    acked = r["acknowledged"]
    assert acked["disk"]["acknowledged"] and acked["remote"]["checked"]
    assert acked["disk_before_db_faults"]["checks"] == 2 and acked["disk_before_db_faults"]["checked"]
    assert acked["disk"]["unreadable"] == 0 and acked["remote"]["unreadable"] == 0, acked
    assert acked["disk_before_db_faults"]["unreadable"] == 0, acked
    assert r["namespace_isolation"]["hits_checked"] and r["namespace_isolation"]["hits_on_another_namespace"] == 0
    assert r["plain_mismatch_between_processes"] == 0
    injected = {f["fault"] for f in r["faults"] if not f.get("skipped")}
    assert set(FAULTS[1:]) <= injected, injected  # every class; the kill in a write below
    assert r["fault_counts"].get(FAULTS[0], 0) >= 1, r["fault_counts"]
    assert r["disk_mode"] in ("tmpfs", "hook")
    assert code == 0
