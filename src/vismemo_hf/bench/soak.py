"""``vismemo bench soak``: several serving processes, one shared disk directory and a local 3-master Redis Cluster,
a mixed request stream, and a driver that injects faults while they serve.

The driver starts a Redis Cluster (``redis-server`` / ``redis-cli`` on free loopback ports, temporary folders), a
disk directory on a size-limited tmpfs (where ``mount`` is allowed; else a write hook fails disk writes with
ENOSPC during the disk-full fault), and ``--processes`` workers (``python -m vismemo_hf.bench.soak --worker
CONFIG``). Every worker builds the same random-weight model (``--preset``, fixed seed), enables it, keeps a
never-enabled copy for references, opens one ``VisMemoStore`` on the shared directory and the cluster with one
store secret and small RAM budgets, and serves its share of one deterministic stream (request ``i`` goes to worker
``i % processes``): new pages (misses), repeats (exact hits), edited and shifted copies (approximate hits), in three
namespaces, some pages asked again in another namespace (never a hit of the first). Per request it runs the plain
model, then the enabled model through its cache, ``store.flush()``es and appends one JSON line (kind, answer
tokens, plain's, TTFT, exception, the keys ``flush()`` acknowledged on disk and in Redis, RSS, open files).

Faults, spread over the run by the number of requests served: a worker SIGKILLed in the middle of a disk write
(the driver arms the worker; its next blob write stops after writing half the file, inside diskcache's transaction
and the directory's lock, and says so; the driver kills it there and starts it again: it resumes its share), a
cluster node SIGKILLed and restarted (its data lost), the disk full (a filler file takes the tmpfs' free space for a
few seconds), Redis ``maxmemory`` reached (every node at its current use, ``noeviction``, for a few seconds), a blob
file truncated or overwritten with another blob's bytes, and the directory's ``cache.db`` overwritten in place or
replaced (a new file) with garbage.

Checks: answers of misses and exact hits equal plain's (tokens); approximate hits differ from plain at no higher a
rate than the same stream routed by one process without faults (the baseline, run first); no exception out of
``generate``; every entry ``flush()`` acknowledged is readable at the end from its tier (disk: unless a directory
fault or a blob fault hit it since; Redis: unless the node holding it was killed since). Reported: requests served
(per process and per second), misses beyond the baseline attributed to the fault whose window they fall in, TTFT
p50 / p99 per kind, RSS and open files per process over the run, orphan blob files left in the directory.
"""

from __future__ import annotations

import argparse
import copy
import errno
import json
import os
import random
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

from vismemo_hf.bench.report import command as report_command
from vismemo_hf.bench.report import header, machine

if TYPE_CHECKING:
    from vismemo_hf.store.entry import Entry

SECRET = "vismemo-soak-store-secret-0123456789"
NAMESPACES = ("tenant-a", "tenant-b", "tenant-c")
QUESTIONS = ("What is the value of row 1?", "What does the page show?", "Read the third row.")
SIZES = ((224, 168), (168, 224), (196, 196))
class _CacheOptions(TypedDict):
    policy: str
    reuse_ratio: float
    entropy_threshold: float


OPTS = _CacheOptions(policy="vismemo", reuse_ratio=0.5, entropy_threshold=1.0)
FAULTS = ("worker SIGKILL in a disk write", "cluster node killed and restarted", "disk full (ENOSPC)",
          "Redis maxmemory reached", "blob truncated", "blob overwritten by another blob", "cache.db overwritten",
          "cache.db replaced")


# -- the stream ---------------------------------------------------------------------------------------------
def make_stream(n: int, seed: int = 0, lag: int = 8) -> list[dict]:
    """``n`` requests: a new page (30 %), a repeat of a page seen at least ``lag`` requests earlier (35 %), an edited
    or shifted copy of one (30 %), or a page of another namespace asked in this one (5 %)."""
    rng = random.Random(seed)
    pages: list[dict] = []  # what was served, with the request index
    out = []
    for i in range(n):
        old = [p for p in pages if p["at"] <= i - lag]
        r = rng.random()
        q = rng.choice(QUESTIONS)
        if not old or r < 0.30:
            spec = {"variant": "new", "ns": rng.choice(NAMESPACES), "page": rng.randrange(10**6),
                    "size": list(rng.choice(SIZES)), "style": rng.choice(("noise", "noise", "form"))}
            pages.append({**spec, "at": i})
        elif r < 0.65:
            spec = {**{k: v for k, v in rng.choice(old).items() if k != "at"}, "variant": "repeat"}
        elif r < 0.95:
            base = rng.choice([p for p in old if p["variant"] in ("new",)] or old)
            edit = rng.random() < 0.6
            spec = {**{k: v for k, v in base.items() if k != "at"}, "variant": "edit" if edit else "shift",
                    "copy": "edit" if edit else "shift",
                    "delta": rng.randrange(1, 4) if not edit else rng.randrange(10**6)}
            if rng.random() < 0.5:  # a copy asked again later: exact when its entry was stored
                pages.append({**spec, "at": i})
        else:
            base = rng.choice(old)
            spec = {**{k: v for k, v in base.items() if k != "at"}, "variant": "cross-namespace",
                    "ns": rng.choice([ns for ns in NAMESPACES if ns != base["ns"]])}
        out.append({"i": i, "q": q, **spec})
    return out


def image_of(spec: dict):
    import numpy as np
    from PIL import Image

    from vismemo_hf.eval import synthdoc, synthetic

    w, h = spec["size"]
    if spec["style"] == "form":
        img = synthetic.page(spec["page"] % 9973, size=(w, h))
    else:
        rng = np.random.RandomState(spec["page"] % 2**31)
        img = Image.fromarray((rng.rand(h, w, 3) * 255).astype("uint8"))
    if spec.get("copy") == "edit":  # a block of the page drawn anew
        rng = np.random.RandomState(spec["delta"] % 2**31)
        arr = np.array(img)
        y, x = rng.randint(0, h - h // 6), rng.randint(0, w - w // 6)
        arr[y : y + h // 8, x : x + w // 8] = (rng.rand(h // 8, w // 8, 3) * 255).astype("uint8")
        img = Image.fromarray(arr)
    elif spec.get("copy") == "shift":  # the page moved a few pixels
        img = synthdoc.shift_image(img, spec["delta"], 0)
    return img


# -- the cluster -------------------------------------------------------------------------------------------
def port_free(port: int) -> bool:
    """Whether ``port`` on loopback can be bound now (tests/conftest.py starts its servers with it too)."""
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


class Cluster:
    """A throwaway Redis Cluster of ``n`` masters on free loopback ports (``redis-cli --cluster create``), the soak's
    and the tests' (``tests/conftest.py``); ``kill(i)`` and ``start(i)`` stop and restart node i on its port with its
    cluster config (its data is lost). ``full_coverage=False`` (the soak's): while a node is down the others serve
    their slots."""

    def __init__(self, directory, n: int = 3, full_coverage: bool = True) -> None:
        server, cli = shutil.which("redis-server"), shutil.which("redis-cli")
        if server is None or cli is None:
            raise RuntimeError("a Redis Cluster needs redis-server and redis-cli (apt-get install redis-server)")
        self.server, self.cli = server, cli
        self.directory, self.full_coverage = str(directory), full_coverage
        self.ports: list[int] = []
        while len(self.ports) < n:  # a node also listens on port + 10000 (its cluster bus): both must be free
            port = random.randrange(20000, 55535)
            if port not in self.ports and port_free(port) and port_free(port + 10000):
                self.ports.append(port)
        self.procs: list[subprocess.Popen[bytes] | None] = [None] * n  # each node's server, once started
        for i in range(n):
            self.start(i, wait_ok=False)
        subprocess.run([self.cli, "--cluster", "create", *[f"127.0.0.1:{p}" for p in self.ports],
                        "--cluster-replicas", "0", "--cluster-yes"], check=True, capture_output=True, timeout=60)
        self.wait_ok()
        self.url = f"redis://127.0.0.1:{self.ports[0]}/0"

    def node(self, i: int):
        import redis

        return redis.Redis(port=self.ports[i], socket_timeout=2)

    def start(self, i: int, wait_ok: bool = True) -> None:
        port = self.ports[i]
        self.procs[i] = subprocess.Popen(
            [self.server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{port}.conf", "--cluster-node-timeout",
             "2000", "--cluster-require-full-coverage", "yes" if self.full_coverage else "no", "--dir",
             self.directory, "--logfile", f"redis-{port}.log"], stdout=subprocess.DEVNULL)
        import redis

        for _ in range(200):
            try:
                self.node(i).ping()
                break
            except redis.ConnectionError:
                time.sleep(0.05)
        else:
            raise RuntimeError("redis-server did not start")
        if wait_ok:
            self.wait_ok()

    def wait_ok(self, timeout: float = 30.0) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            try:
                if all(self.node(i).cluster("info").get("cluster_state") == "ok" for i in range(len(self.ports))):
                    return
            except Exception:  # noqa: BLE001 - a node still starting
                pass
            time.sleep(0.05)
        raise RuntimeError("the cluster did not reach cluster_state:ok")

    def kill(self, i: int) -> None:
        proc = self.procs[i]
        assert proc is not None  # every node was started in __init__
        proc.send_signal(signal.SIGKILL)
        proc.wait()

    def node_of(self, name: str) -> int:
        """Which node serves Redis key ``name`` now."""
        from redis.cluster import key_slot

        slot = key_slot(name.encode())
        for start, end, master, *_ in self.node(0).execute_command("CLUSTER", "SLOTS"):
            if start <= slot <= end:
                return self.ports.index(int(master[1]))
        raise KeyError(name)

    def move_slot(self, name: str, to: int) -> None:
        """Reshard: the slot of Redis key ``name`` (and its keys) moves to node ``to``, as ``redis-cli --cluster
        reshard`` does it (IMPORTING / MIGRATING, MIGRATE of every key, SETSLOT NODE on every node)."""
        from redis.cluster import key_slot

        slot, source = key_slot(name.encode()), self.node_of(name)
        src, dst = self.node(source), self.node(to)
        src_id, dst_id = src.execute_command("CLUSTER", "MYID"), dst.execute_command("CLUSTER", "MYID")
        dst.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", src_id)
        src.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", dst_id)
        while keys := src.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 100):
            src.execute_command("MIGRATE", "127.0.0.1", self.ports[to], "", 0, 5000, "KEYS", *keys)
        for i in range(len(self.ports)):
            self.node(i).execute_command("CLUSTER", "SETSLOT", slot, "NODE", dst_id)
        self.wait_ok()

    def client(self):
        from redis.cluster import RedisCluster as Client

        return Client(host="127.0.0.1", port=self.ports[0])

    def close(self) -> None:
        for proc in self.procs:
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()


# -- a worker ----------------------------------------------------------------------------------------------
class _WriteProbe:
    """What the disk tier's ``_store`` hands diskcache to copy into a blob file (it stands in for ``io.BytesIO``):
    the bytes in two halves. Between them, if the driver armed this worker, it says so and waits to be killed; in
    the hook mode of the disk-full fault it fails with ENOSPC instead."""

    def __init__(self, data: bytes, control: Path, wid: int) -> None:
        self.data, self.pos, self.control, self.wid = bytes(data), 0, control, wid

    def read(self, size: int = -1) -> bytes:
        if self.pos >= len(self.data):
            return b""
        if self.pos > 0:
            if (self.control / "enospc").exists():
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            arm = self.control / f"arm-{self.wid}"
            if arm.exists():
                (self.control / f"inwrite-{self.wid}").write_text(str(os.getpid()))
                time.sleep(120)  # the driver kills us here, half the file written
        half = max(1, len(self.data) // 2) if self.pos == 0 else len(self.data) - self.pos
        if size is not None and size >= 0:
            half = min(half, size)
        out = self.data[self.pos : self.pos + half]
        self.pos += len(out)
        return out


def _install_probe(control: Path, wid: int) -> None:
    from vismemo_hf.store.tiers import disk as disk_tier

    class _Shim:
        @staticmethod
        def BytesIO(data):  # noqa: N802 - stands in for io.BytesIO inside tiers/disk.py only
            return _WriteProbe(data, control, wid)

    disk_tier.io = _Shim  # type: ignore[assignment]  # a duck-typed stand-in for the io module (disk.py uses BytesIO only)


def _rss_kb() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _served(out_path: Path) -> set:
    """The requests a results file records (a line cut by SIGKILL is skipped)."""
    done = set()
    if out_path.exists():
        for line in out_path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if "i" in rec:
                done.add(rec["i"])
    return done


def _served_by_vismemo(store, model, inputs, req, run, p_tokens, p_scores) -> dict:
    """One request through the enabled model: its event, its agreement with plain transformers, and whether its
    entry was acknowledged by the disk and the remote tiers (or the exception, which must never happen)."""
    import vismemo_hf

    rec: dict[str, Any] = {}
    remote_writes = store.remote.counters["writes"] if store.remote is not None else 0
    puts = store._stats["puts"]
    try:
        cache = vismemo_hf.VisMemoCache(store=store, namespace=req["ns"], **OPTS)
        tokens, scores, ttft = run(model, inputs, cache)
        event = cache.events[0]
        rec.update(kind=str(event.kind), fallback=event.fallback, key=event.key, alias=event.alias,
                   tokens=tokens, ttft_ms=ttft,
                   equal=tokens == p_tokens, score_diff=float((scores - p_scores).abs().max()),
                   error=None)
        store.flush()
        key = event.key
        wrote_remote = store.remote is not None and store.remote.counters["writes"] > remote_writes
        on_disk = store.disk is not None and key in store.disk.lru and not store.disk.read_only
        fp = store.catalog.fingerprint_of(key)
        rec["acked"] = {"disk": bool(on_disk and store._stats["puts"] > puts),
                        "remote": bool(wrote_remote), "fingerprint": fp, "t": time.time()}
    except Exception as err:  # noqa: BLE001 - what the soak counts: must never happen
        rec.update(error=f"{type(err).__name__}: {err}", trace=traceback.format_exc()[-2000:])
    return rec


def worker(config_path: str) -> int:
    """Serve this worker's share of the stream (``i % processes == wid``), resuming after the last request its
    results file records."""
    import logging

    import torch
    from transformers import StoppingCriteriaList

    import vismemo_hf
    from vismemo_hf.eval.loading import load_model
    from vismemo_hf.eval.quality import TokenClock

    cfg = json.loads(Path(config_path).read_text())
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING, filename=cfg["log"], format="%(asctime)s %(process)d %(message)s")
    control, wid, out_path = Path(cfg["control"]), cfg["wid"], Path(cfg["results"])
    if wid >= 0:
        _install_probe(control, wid)
    done = _served(out_path)
    with open(out_path, "a") as out:
        def emit(rec):
            out.write(json.dumps(rec) + "\n")
            out.flush()

        emit({"start": os.getpid(), "t": time.time(), "rss_kb": _rss_kb(), "fds": _fds()})
        model, processor = load_model(cfg["preset"], cfg.get("family"), seed=cfg["model_seed"])
        plain = copy.deepcopy(model).eval()
        vismemo_hf.enable(model)
        t_open = time.time()
        store = vismemo_hf.VisMemoStore(device_bytes=cfg["device_bytes"], host_bytes=cfg["host_bytes"],
                                        disk_dir=cfg["disk_dir"], disk_bytes=cfg["disk_bytes"],
                                        remote_url=cfg.get("remote_url"),
                                        remote_options={"refresh_s": 0.2, "retry_s": 1.0, "timeout_s": 0.5},
                                        secret=SECRET)
        emit({"ready": os.getpid(), "t": time.time(), "t_open": t_open, "rss_kb": _rss_kb(), "fds": _fds()})
        stream = make_stream(cfg["requests"], cfg["stream_seed"])
        n_proc = max(1, cfg["processes"])
        mine = [r for r in stream if (wid < 0 or r["i"] % n_proc == wid) and r["i"] not in done]
        new_tokens = cfg["max_new_tokens"]

        def run(runner, inputs, cache):
            clock = TokenClock()
            t0 = time.perf_counter()
            with torch.no_grad():
                res = runner.generate(**inputs, **({"cache": cache} if cache is not None else {}),
                                      max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                      output_scores=True, return_dict_in_generate=True,
                                      stopping_criteria=StoppingCriteriaList([clock]))
            tokens = res.sequences[0, inputs["input_ids"].shape[1] :].tolist()
            return tokens, torch.stack(res.scores, 1)[0], (clock.times[0] - t0) * 1e3

        for req in mine:
            messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": req["q"]}]}]
            text = processor.apply_chat_template(messages, add_generation_prompt=True)
            inputs = processor(text=[text], images=[image_of(req)], return_tensors="pt")
            rec = {"i": req["i"], "w": wid, "pid": os.getpid(), "ns": req["ns"], "variant": req["variant"],
                   "t0": time.time()}
            p_tokens, p_scores, p_ttft = run(plain, inputs, None)
            rec.update(plain_tokens=p_tokens, plain_ttft_ms=p_ttft)
            rec.update(_served_by_vismemo(store, model, inputs, req, run, p_tokens, p_scores))
            rec.update(t1=time.time(), rss_kb=_rss_kb(), fds=_fds())
            emit(rec)
            if cfg.get("pace_ms"):
                time.sleep(cfg["pace_ms"] / 1e3)
        store.flush()
        stats = store.stats()
        emit({"done": os.getpid(), "t": time.time(), "rss_kb": _rss_kb(), "fds": _fds(),
              "stats": {k: stats[k] for k in ("hits", "corrupt", "forged", "write_failures", "quarantined", "puts")},
              "disk": stats["tiers"]["disk"], "remote": stats["tiers"]["remote"]})
        store.close()
    return 0


# -- the driver --------------------------------------------------------------------------------------------
class Driver:
    def __init__(self, args, root: Path) -> None:
        self.args, self.root = args, root
        self.control = root / "control"
        self.control.mkdir(parents=True, exist_ok=True)
        self.results = root / "results"
        self.results.mkdir(exist_ok=True)
        self.disk_dir = root / "disk"
        self.disk_dir.mkdir(exist_ok=True)
        self.mounted = False
        self.procs: dict[int, subprocess.Popen] = {}
        self.starts: dict[int, list[float]] = {}
        self.faults: list[dict] = []
        self.offsets: dict[int, int] = {}
        self.served: set[int] = set()
        self.crashes = 0
        self.last_db_fault = 0.0
        self.deferred = 0  # blob faults put off (no readable index, too few blobs)
        self.midchecks: list[dict] = []  # disk checks of the acknowledged entries just before each cache.db fault

    # -- the directory -----------------------------------------------------------------------------------
    def mount(self) -> None:
        size = int(self.args.tmpfs_mib) << 20
        try:
            subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(self.disk_dir)], check=True,
                           capture_output=True, timeout=20)
            self.mounted = True
        except Exception:  # noqa: BLE001 - not allowed here: the hook mode of the disk-full fault
            self.mounted = False

    def unmount(self) -> None:
        if self.mounted:
            subprocess.run(["umount", "-l", str(self.disk_dir)], capture_output=True, timeout=20)

    # -- workers -----------------------------------------------------------------------------------------
    def config(self, wid: int, results: Path, disk_dir: Path, remote_url, processes: int) -> Path:
        a = self.args
        cfg = {"wid": wid, "processes": processes, "requests": a.requests, "stream_seed": a.seed,
               "model_seed": 0, "preset": a.preset, "family": a.family, "max_new_tokens": a.max_new_tokens,
               "disk_dir": str(disk_dir), "disk_bytes": int(a.disk_mib) << 20, "device_bytes": a.device_kib << 10,
               "host_bytes": a.host_kib << 10, "pace_ms": a.pace_ms if wid >= 0 else 0, "remote_url": remote_url,
               "control": str(self.control),
               "results": str(results), "log": str(self.root / f"worker-{wid}.log")}
        path = self.control / f"config-{wid}.json"
        path.write_text(json.dumps(cfg))
        return path

    def spawn(self, wid: int) -> None:
        env = {**os.environ, "VISMEMO_STORE": "memory", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
        self.procs[wid] = subprocess.Popen([sys.executable, "-m", "vismemo_hf.bench.soak", "--worker",
                                            str(self.control / f"config-{wid}.json")], env=env,
                                           stdout=subprocess.DEVNULL, stderr=open(self.root / f"worker-{wid}.err", "ab"))
        self.starts.setdefault(wid, []).append(time.time())

    def poll_results(self) -> None:
        for wid in self.procs:
            path = self.results / f"worker-{wid}.jsonl"
            if not path.exists():
                continue
            with open(path) as f:
                f.seek(self.offsets.get(wid, 0))
                chunk = f.read()
            complete = chunk[: chunk.rfind("\n") + 1]
            self.offsets[wid] = self.offsets.get(wid, 0) + len(complete)
            for line in complete.splitlines():
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                if "i" in rec:
                    self.served.add(rec["i"])

    def supervise(self) -> None:
        """Restart a worker that died on its own (counted: a crash), and read what was served."""
        self.poll_results()
        for wid, proc in self.procs.items():
            code = proc.poll()
            if code is not None and code != 0 and not self._finished(wid):
                self.crashes += 1
                self.spawn(wid)

    def _finished(self, wid: int) -> bool:
        path = self.results / f"worker-{wid}.jsonl"
        return path.exists() and '"done"' in path.read_text()[-20000:]

    def alive(self) -> list[int]:
        return [w for w, p in self.procs.items() if p.poll() is None]

    def wait_served(self, count: int) -> None:
        while len(self.served) < count and self.alive():
            self.supervise()
            time.sleep(0.1)

    def sleep(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self.supervise()
            time.sleep(0.1)

    # -- faults ------------------------------------------------------------------------------------------
    def fault(self, name: str, start: float, **info) -> dict:
        rec = {"fault": name, "t_start": start, "t_end": time.time(), "served_at": len(self.served), **info}
        self.faults.append(rec)
        return rec

    def kill_in_write(self, rng) -> bool:
        """SIGKILL a worker in the middle of a blob write and start it again. Workers that opened the directory after
        the last ``cache.db`` fault are armed first (an older one may have a disk tier that writes nothing); a worker
        whose write does not come within ``arm_timeout`` is killed anyway (counted apart) and another one tried."""
        for _ in range(3):
            alive = self.alive()
            healthy = [w for w in alive if self.starts[w][-1] > self.last_db_fault]
            if not alive:
                return False
            if self._kill(rng.choice(healthy or alive)):
                return True
        return False

    def _kill(self, wid: int) -> bool:
        arm, marker = self.control / f"arm-{wid}", self.control / f"inwrite-{wid}"
        start = time.time()
        arm.write_text("1")
        end = time.monotonic() + self.args.arm_timeout
        landed = False
        while time.monotonic() < end and self.procs[wid].poll() is None:
            if marker.exists():
                landed = True
                break
            time.sleep(0.01)
        proc = self.procs[wid]
        finished = proc.poll() is not None and not landed  # it ended its share meanwhile: nothing killed
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
        proc.wait()
        arm.unlink(missing_ok=True)
        marker.unlink(missing_ok=True)
        if finished:
            return False
        self.fault(FAULTS[0] if landed else "worker SIGKILL (no write came)", start, worker=wid)
        self.poll_results()
        if not self._finished(wid):
            self.spawn(wid)
        return landed

    def node_kill(self, cluster: Cluster, rng) -> None:
        i = rng.randrange(len(cluster.ports))
        start = time.time()
        cluster.kill(i)
        self.sleep(self.args.node_down_s)
        cluster.start(i, wait_ok=False)
        try:
            cluster.wait_ok()
        except RuntimeError:
            pass
        self.fault(FAULTS[1], start, node=i, t_killed=start)

    def disk_full(self) -> None:
        start = time.time()
        filler = self.disk_dir / "soak-filler"
        if self.mounted:  # a real ENOSPC: a filler file takes the tmpfs' free space
            fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                for size in (1 << 20, 4096, 1):
                    while True:
                        try:
                            os.write(fd, b"\0" * size)
                        except OSError:
                            break
            finally:
                os.close(fd)
        else:
            (self.control / "enospc").write_text("1")
        self.sleep(self.args.fault_s)
        try:
            filler.unlink()
        except (FileNotFoundError, OSError):
            pass
        (self.control / "enospc").unlink(missing_ok=True)
        self.fault(FAULTS[2], start, mode="tmpfs" if self.mounted else "hook")

    def redis_full(self, cluster: Cluster) -> None:
        start = time.time()
        for i in range(len(cluster.ports)):
            try:
                node = cluster.node(i)
                used = int(node.info("memory")["used_memory"])
                node.config_set("maxmemory-policy", "noeviction")
                node.config_set("maxmemory", str(used + (64 << 10)))
            except Exception:  # noqa: BLE001 - a node restarting
                pass
        self.sleep(self.args.fault_s)
        for i in range(len(cluster.ports)):
            try:
                cluster.node(i).config_set("maxmemory", "0")
            except Exception:  # noqa: BLE001
                pass
        self.fault(FAULTS[3], start)

    def _blob_files(self) -> list[tuple[str, str]]:
        try:
            db = sqlite3.connect(f"file:{self.disk_dir / 'cache.db'}?mode=ro", uri=True, timeout=5)
            rows = db.execute("SELECT key, filename FROM Cache WHERE filename IS NOT NULL").fetchall()
            db.close()
        except sqlite3.Error:
            return []
        return [(k, f) for k, f in rows if isinstance(k, str) and (self.disk_dir / f).exists()]

    def damage_blob(self, rng, overwrite: bool) -> bool:
        start = time.time()
        files = self._blob_files()
        if len(files) < 2:  # no readable index (a cache.db fault not yet quarantined) or too few blobs: later
            self.deferred += 1
            return False
        (key, name), (_, other) = rng.sample(files, 2)
        path = self.disk_dir / name
        try:
            if overwrite:  # another blob's valid, sealed bytes under this key's file
                data = (self.disk_dir / other).read_bytes()
                with open(path, "r+b") as f:
                    f.truncate(0)
                    f.write(data)
            else:
                size = path.stat().st_size
                with open(path, "r+b") as f:
                    f.truncate(rng.randrange(1, max(2, size)))
        except OSError:  # deleted meanwhile
            self.deferred += 1
            return False
        self.fault(FAULTS[5 if overwrite else 4], start, key=key)
        return True

    def damage_db(self, rng, replace: bool) -> None:
        start = time.time()
        db = self.disk_dir / "cache.db"
        garbage = os.urandom(max(8192, db.stat().st_size if db.exists() else 8192))
        if replace:  # a new file under the name (the old one lives on in processes that have it open)
            tmp = self.disk_dir / "soak-garbage.tmp"
            tmp.write_bytes(garbage)
            os.replace(tmp, db)
        else:  # the same file overwritten in place
            with open(db, "r+b") as f:
                f.write(garbage)
                f.flush()
        self.last_db_fault = time.time()
        self.fault(FAULTS[7 if replace else 6], start)


def _plan(args, rng) -> list[tuple[float, str]]:
    """(share of the requests served, fault) for every fault, spread over the run."""
    events = []

    def spread(n, name, lo=0.05, hi=0.92):
        for k in range(n):
            events.append((lo + (hi - lo) * (k + rng.random()) / max(1, n), name))

    spread(args.kills, "kill", 0.03, 0.85)
    spread(args.node_kills, "node")
    spread(args.disk_full, "disk_full")
    spread(args.redis_full, "redis_full")
    spread(args.blob_faults, "truncate", 0.05, 0.42)  # before the cache.db faults: the index names the blobs
    spread(args.blob_faults, "overwrite", 0.05, 0.42)
    spread(args.db_faults, "db_overwrite", 0.45, 0.6)  # late: every worker opened before one has a stale index
    spread(args.db_faults, "db_replace", 0.7, 0.85)
    return sorted(events)


def _read_jsonl(path: Path) -> list[dict]:
    out: list[dict] = []
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def check_acknowledged(records: list[dict], faults: list[dict], starts: dict, disk_dir: Path, remote_url,
                       cluster: Cluster | None, args) -> dict:
    """Every entry ``flush()`` acknowledged that no fault touched since is readable from its tier now."""
    import vismemo_hf

    db_faults = [f["t_start"] for f in faults if f["fault"].startswith("cache.db")]
    damaged: dict[str, list[float]] = {}
    for f in faults:
        if f["fault"].startswith("blob") and f.get("key"):
            damaged.setdefault(f["key"], []).append(f["t_start"])
    node_kills = [(f["node"], f["t_start"]) for f in faults if f["fault"] == FAULTS[1]]
    start_of = {rec["ready"]: rec["t_open"] for rec in records if "ready" in rec}  # when each process opened its store
    disk_last, remote_last = {}, {}
    for rec in records:
        acked = rec.get("acked")
        if not acked:
            continue
        if acked["disk"]:
            disk_last[rec["key"]] = (acked["t"], acked["fingerprint"], rec["pid"])
        if acked["remote"]:
            remote_last[rec["key"]] = (acked["t"], acked["fingerprint"], rec["pid"])
    out: dict[str, dict[str, Any]]
    out = {"disk": {"acknowledged": len(disk_last), "checked": 0, "excluded_by_fault": 0, "unreadable": 0,
                    "unreadable_keys": [], "stale_index": 0, "stale_index_unreadable": 0},
           "remote": {"acknowledged": len(remote_last), "checked": 0, "excluded_by_fault": 0, "unreadable": 0,
                      "unreadable_keys": []}}
    disk_store = vismemo_hf.VisMemoStore(device_bytes=0, host_bytes=0, disk_dir=str(disk_dir),
                                         disk_bytes=int(args.disk_mib) << 20, secret=SECRET)
    entry: Entry | Exception | None  # what a read gave: the entry, nothing, or the exception
    for key, (t, fp, pid) in disk_last.items():
        opened = start_of.get(pid, 0.0)
        if any(d > t for d in db_faults) or any(d > t for d in damaged.get(key, [])):
            out["disk"]["excluded_by_fault"] += 1  # its index or its blob destroyed since
            continue
        stale = any(opened - 1.0 < d < t for d in db_faults)  # acknowledged by a process that opened the old index
        try:
            entry = disk_store.disk.full(key) if disk_store.disk is not None else None
            ok = entry is not None and entry.key == key and entry.fingerprint == fp
        except Exception as err:  # noqa: BLE001
            ok, entry = False, err
        if stale:
            out["disk"]["stale_index"] += 1
            out["disk"]["stale_index_unreadable"] += int(not ok)
            continue
        out["disk"]["checked"] += 1
        if not ok:
            out["disk"]["unreadable"] += 1
            out["disk"]["unreadable_keys"].append([key, repr(entry)[:200]])
    out["disk"]["quarantined_at_check"] = disk_store.stats()["quarantined"]
    disk_store.close()
    if remote_url is not None and remote_last:
        remote_store = vismemo_hf.VisMemoStore(device_bytes=0, host_bytes=0, remote_url=remote_url, secret=SECRET,
                                               remote_options={"timeout_s": 2.0})
        remote = remote_store.remote
        assert remote is not None and cluster is not None  # remote_url: the soak's cluster, the store's only tier
        remote.available()
        for key, (t, fp, _) in remote_last.items():
            node = cluster.node_of(remote._blob_key(key))
            if any(n == node and tk > t - 1.0 for n, tk in node_kills):
                out["remote"]["excluded_by_fault"] += 1
                continue
            out["remote"]["checked"] += 1
            try:
                entry = remote.full(key)
                ok = entry.key == key and entry.fingerprint == fp
            except Exception as err:  # noqa: BLE001
                ok, entry = False, err
            if not ok:
                out["remote"]["unreadable"] += 1
                out["remote"]["unreadable_keys"].append([key, repr(entry)[:200]])
        remote_store.close()
    return out


def orphan_files(disk_dir: Path) -> dict:
    """Blob files in the directory's value folders that its index does not name (writes cut by SIGKILL, ...)."""
    named = set()
    try:
        db = sqlite3.connect(f"file:{disk_dir / 'cache.db'}?mode=ro", uri=True)
        named = {f for (f,) in db.execute("SELECT filename FROM Cache WHERE filename IS NOT NULL")}
        db.close()
    except sqlite3.Error:
        pass
    files, size = [], 0
    for sub in disk_dir.iterdir():
        if sub.is_dir() and len(sub.name) == 2:
            for p in sub.rglob("*.val"):
                rel = str(p.relative_to(disk_dir))
                if rel not in named:
                    files.append(rel)
                    size += p.stat().st_size
    quarantine = disk_dir / "quarantine"
    return {"orphans": len(files), "orphan_bytes": size, "named": len(named),
            "quarantine_folders": len(list(quarantine.iterdir())) if quarantine.exists() else 0}


def _pct(xs, q):
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def _final(records: list[dict]) -> dict[int, dict]:
    """The last attempt of every request index (a request cut by SIGKILL is served again by the restarted worker)."""
    out = {}
    for rec in records:
        if "i" in rec:
            out[rec["i"]] = rec
    return out


def summarise(soak: dict[int, dict], base: dict[int, dict], faults: list[dict], grace: float) -> dict:
    kinds = ("miss", "exact", "approximate")
    rows = {}
    for label, recs in (("soak", soak), ("baseline", base)):
        per = {}
        for kind in kinds:
            sel = [r for r in recs.values() if r.get("kind") == kind]
            per[kind] = {"n": len(sel), "differ": sum(1 for r in sel if not r["equal"]),
                         "ttft_p50_ms": _pct([r["ttft_ms"] for r in sel], 0.5),
                         "ttft_p99_ms": _pct([r["ttft_ms"] for r in sel], 0.99)}
        per["plain"] = {"n": len(recs), "ttft_p50_ms": _pct([r["plain_ttft_ms"] for r in recs.values()], 0.5),
                        "ttft_p99_ms": _pct([r["plain_ttft_ms"] for r in recs.values()], 0.99)}
        rows[label] = per
    plain_mismatch = sum(1 for i, r in soak.items() if i in base and r["plain_tokens"] != base[i]["plain_tokens"])
    # misses beyond the baseline, attributed to the latest fault whose window holds the request's start
    windows = sorted(((f["t_start"], f["t_end"] + grace, f["fault"]) for f in faults), key=lambda w: w[0])
    attributed = {name: 0 for name in {f["fault"] for f in faults}}
    attributed["none (interleaving of processes)"] = 0
    hits_beyond = 0
    for i, r in soak.items():
        b = base.get(i)
        if b is None or r.get("kind") is None:
            continue
        if r["kind"] == "miss" and b["kind"] != "miss":
            where = [w for w in windows if w[0] <= r["t0"] <= w[1]]
            attributed[where[-1][2] if where else "none (interleaving of processes)"] += 1
        elif r["kind"] != "miss" and b["kind"] == "miss":
            hits_beyond += 1
    cross = [r for r in soak.values() if r.get("variant") == "cross-namespace"]
    # a hit must reuse an entry of its own namespace: the namespace of the request(s) whose own key the alias is
    ns_of: dict[str, set[str]] = {}
    for r in soak.values():
        if r.get("key"):
            ns_of.setdefault(r["key"], set()).add(r["ns"])
    hits = [r for r in soak.values() if r.get("kind") in ("exact", "approximate") and r.get("alias") in ns_of]
    foreign = [r["i"] for r in hits if ns_of[r["alias"]] != {r["ns"]}]
    return {"namespace_isolation": {"hits_checked": len(hits), "hits_on_another_namespace": len(foreign),
                                    "requests": foreign[:20]},
            "kinds": rows, "plain_mismatch_between_processes": plain_mismatch, "extra_misses": attributed,
            "hits_beyond_baseline": hits_beyond,
            "cross_namespace": {"n": len(cross), "exact": sum(1 for r in cross if r.get("kind") == "exact")}}


def _inject(drv, cluster, args, rng) -> None:
    """The fault plan, each fault once its share of the stream is served (a fault that found nothing to hit is
    tried again a little later)."""
    plan, extra_kills = _plan(args, rng), args.kills
    while plan:
        share, name = plan.pop(0)
        drv.wait_served(int(share * args.requests))
        if not drv.alive():
            break
        if name == "kill":
            if not drv.kill_in_write(rng) and extra_kills > 0 and share < 0.9:  # try again a little later
                extra_kills -= 1
                plan = sorted([*plan, (min(0.9, share + 0.02), name)])
        elif name == "node":
            drv.node_kill(cluster, rng)
        elif name == "disk_full":
            drv.disk_full()
        elif name == "redis_full":
            drv.redis_full(cluster)
        elif name in ("truncate", "overwrite"):
            if not drv.damage_blob(rng, overwrite=name == "overwrite") and share < 0.97:
                plan = sorted([*plan, (min(0.97, share + 0.03), name)])
        elif name in ("db_overwrite", "db_replace"):
            # what the directory holds now is about to go: check every acknowledged entry first
            so_far = [r for w in range(args.processes) for r in _read_jsonl(drv.results / f"worker-{w}.jsonl")]
            mid = check_acknowledged(so_far, drv.faults, drv.starts, drv.disk_dir, None, None, args)["disk"]
            drv.midchecks.append({**mid, "t": time.time()})
            drv.damage_db(rng, replace=name == "db_replace")
        if not args.quiet:
            print(f"soak: {len(drv.served)}/{args.requests} served, {name}", flush=True)


def _per_process(records: list[dict]) -> dict:
    """pid -> its samples (time, RSS, open files, served) and, once it ended cleanly, its store's counters."""
    procs: dict[int, dict[str, Any]] = {}
    for r in records:
        pid = r.get("pid") or r.get("start") or r.get("ready") or r.get("done")
        if pid is None:
            continue
        p = procs.setdefault(pid, {"pid": pid, "samples": [], "served": 0})
        p["samples"].append([r.get("t1") or r.get("t"), r["rss_kb"], r["fds"], int("i" in r)])
        p["served"] += int("i" in r)
        if "w" in r:
            p["worker"] = r["w"]
        if "done" in r:
            p["done"] = {"stats": r["stats"], "disk": r["disk"], "remote": r["remote"]}
    return procs


def _per_worker(soak: dict) -> dict:
    per_worker: dict[int, int] = {}
    for r in soak.values():
        per_worker[r["w"]] = per_worker.get(r["w"], 0) + 1
    return per_worker


def _counts(faults: list[dict]) -> dict:
    counts: dict[str, int] = {}
    for f in faults:
        counts[f["fault"]] = counts.get(f["fault"], 0) + 1
    return counts


def run(args) -> dict:
    rng = random.Random(args.seed)
    root = Path(tempfile.mkdtemp(prefix="vismemo-soak-"))
    drv = Driver(args, root)
    cluster = baseline = None
    t_begin = time.time()
    try:
        # the baseline: one process, no faults, its own directory, no Redis
        base_dir = root / "baseline-disk"
        drv.config(-1, drv.results / "baseline.jsonl", base_dir, None, 1)
        drv.spawn(-1)
        base_t0 = time.time()
        baseline = drv.procs.pop(-1)
        if not args.baseline_alongside:
            baseline.wait()
            base_s = time.time() - base_t0
            if not args.quiet:
                print(f"soak: baseline done in {base_s:.0f} s", flush=True)
        (root / "cluster").mkdir()
        cluster = Cluster(str(root / "cluster"), 3, full_coverage=False)
        drv.mount()
        for wid in range(args.processes):
            drv.config(wid, drv.results / f"worker-{wid}.jsonl", drv.disk_dir, cluster.url, args.processes)
        soak_t0 = time.time()
        for wid in range(args.processes):
            drv.spawn(wid)
        _inject(drv, cluster, args, rng)
        while drv.alive():
            drv.supervise()
            time.sleep(0.2)
        drv.supervise()
        soak_s = time.time() - soak_t0
        if args.baseline_alongside:
            baseline.wait()
            base_s = time.time() - base_t0
        base = _final(_read_jsonl(drv.results / "baseline.jsonl"))
        records = [r for w in range(args.processes) for r in _read_jsonl(drv.results / f"worker-{w}.jsonl")]
        cluster.wait_ok()
        acked = check_acknowledged(records, drv.faults, drv.starts, drv.disk_dir, cluster.url, cluster, args)
        acked["disk_before_db_faults"] = {
            "checks": len(drv.midchecks), "checked": sum(m["checked"] for m in drv.midchecks),
            "unreadable": sum(m["unreadable"] for m in drv.midchecks),
            "unreadable_keys": [k for m in drv.midchecks for k in m["unreadable_keys"]][:20]}
        orphans = orphan_files(drv.disk_dir)
        soak = _final(records)
        summary = summarise(soak, base, drv.faults, args.grace_s)
        errors = [r for r in records if r.get("error")]
        procs, per_worker, fault_counts = _per_process(records), _per_worker(soak), _counts(drv.faults)
        return {"requests": args.requests, "served": len(soak), "attempts": sum(1 for r in records if "i" in r),
                "processes": args.processes, "soak_s": soak_s, "baseline_s": base_s, "total_s": time.time() - t_begin,
                "requests_per_s": len(soak) / soak_s if soak_s else None, "served_per_worker": per_worker,
                "exceptions": len(errors), "exception_samples": [e["error"] + "\n" + e.get("trace", "")
                                                                  for e in errors[:5]],
                "crashes": drv.crashes, "faults": drv.faults, "blob_faults_deferred": drv.deferred,
                "fault_counts": fault_counts,
                "disk_mode": "tmpfs" if drv.mounted else "hook", "acknowledged": acked, "directory": orphans,
                **summary, "processes_over_time": list(procs.values()),
                "worker_log_warnings": _log_summary(root)}
    finally:
        for proc in [*drv.procs.values(), *([baseline] if baseline is not None else [])]:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if cluster is not None:
            cluster.close()
        drv.unmount()
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
        elif not args.quiet:
            print(f"soak: kept {root}")


def _log_summary(root: Path) -> dict:
    """How often each kind of warning the store logged appears in the workers' logs (first words of the message)."""
    import re

    counts: dict[str, int] = {}
    for log in root.glob("worker-*.log"):
        for line in log.read_text(errors="replace").splitlines():
            m = re.search(r"vismemo: (.{0,60})", line)
            if m:
                text = re.sub(r"[0-9a-f]{8,}|\d+", "N", m.group(1))
                counts[text] = counts.get(text, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: -kv[1])[:25])


def _plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    t0 = min((s[0] for p in result["processes_over_time"] for s in p["samples"] if s[0]), default=0)
    for p in result["processes_over_time"]:
        xs = [s[0] - t0 for s in p["samples"] if s[0]]
        label = f"worker {p.get('worker', '?')}, pid {p['pid']}"
        ax1.plot(xs, [s[1] / 1024 for s in p["samples"] if s[0]], lw=0.8, label=label)
        ax2.plot(xs, [s[2] for s in p["samples"] if s[0]], lw=0.8, label=label)
    for f in result["faults"]:
        for ax in (ax1, ax2):
            ax.axvline(f["t_start"] - t0, color="grey", alpha=0.25, lw=0.6)
    ax1.set(xlabel="time since the first worker started, s", ylabel="RSS, MiB", title="RSS per process")
    ax1.legend(fontsize=6, ncol=2)
    ax2.set(xlabel="time since the first worker started, s", ylabel="open files",
            title="open files per process (grey: faults)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _bounded(p: dict) -> dict | None:
    """RSS and open files of one process while it served (its requests' samples): first, max, last, and the growth
    from the first served request to the last."""
    samples = [s for s in p["samples"] if s[0] and s[3]]
    if not samples:
        return None
    rss, fds = [s[1] / 1024 for s in samples], [s[2] for s in samples]
    return {"rss_mib_first": rss[0], "rss_mib_max": max(rss), "rss_mib_last": rss[-1], "rss_mib_growth": rss[-1] - rss[0],
            "fds_first": fds[0], "fds_max": max(fds), "fds_last": fds[-1]}


def main(args) -> int:
    result = run(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = report_command("bench soak", args, ["processes", "requests", "seed", "kills", "node_kills", "preset",
                                                  "max_new_tokens"])
    mach = machine(note=f"{os.cpu_count()} cores")
    for p in result["processes_over_time"]:
        p["bounds"] = _bounded(p)
    (out / "soak.json").write_text(json.dumps({"command": command, "machine": mach, **result}, indent=1))
    _plot(result, out / "soak.png")
    lines = report(result, command, mach)
    (out / "soak.md").write_text("\n".join(lines) + "\n")
    if not args.quiet:
        print("\n".join(lines))
    ok = (result["exceptions"] == 0 and result["acknowledged"]["disk"]["unreadable"] == 0
          and result["acknowledged"]["disk_before_db_faults"]["unreadable"] == 0
          and result["acknowledged"]["remote"]["unreadable"] == 0
          and all(result["kinds"]["soak"][k]["differ"] == 0 for k in ("miss", "exact")))
    return 0 if ok else 1


def _ms(x):
    return "-" if x is None else f"{x:.1f}"


def report(r: dict, command: str, mach: str) -> list[str]:
    k, b = r["kinds"]["soak"], r["kinds"]["baseline"]
    lines = header("Soak: processes, a shared directory and a Redis Cluster under faults", command, mach) + [
        f"{r['processes']} processes served {r['served']} of {r['requests']} requests ({r['attempts']} attempts: a "
        f"request cut by a kill is served again) in {r['soak_s']:.0f} s, {r['requests_per_s']:.2f} requests/s "
        f"(per process: {', '.join(f'{w}: {n}' for w, n in sorted(r['served_per_worker'].items()))}); the baseline "
        f"(one process, no faults, its own directory, no Redis) took {r['baseline_s']:.0f} s. One disk directory "
        f"(disk-full fault: {r['disk_mode']}), one 3-master Redis Cluster, one store secret, three namespaces.", "",
        f"- **Exceptions out of `generate`: {r['exceptions']}**; worker crashes (deaths not caused by the driver): "
        f"{r['crashes']}",
        f"- **Acknowledged by `flush()` and unreadable while their tier is up: disk "
        f"{r['acknowledged']['disk']['unreadable']} of {r['acknowledged']['disk']['checked']} checked at the end and "
        f"{r['acknowledged']['disk_before_db_faults']['unreadable']} of "
        f"{r['acknowledged']['disk_before_db_faults']['checked']} checked just before the "
        f"{r['acknowledged']['disk_before_db_faults']['checks']} `cache.db` fault(s), Redis "
        f"{r['acknowledged']['remote']['unreadable']} of {r['acknowledged']['remote']['checked']} checked** "
        f"(acknowledged: disk {r['acknowledged']['disk']['acknowledged']}, Redis "
        f"{r['acknowledged']['remote']['acknowledged']}; not checked because a fault hit them since: disk "
        f"{r['acknowledged']['disk']['excluded_by_fault']} (a `cache.db` fault or damage to their blob after "
        f"they were acknowledged), Redis {r['acknowledged']['remote']['excluded_by_fault']} (their node "
        "killed since)); acknowledged on disk after a `cache.db` fault by a process that had opened the directory "
        f"before it (its index the old one): {r['acknowledged']['disk']['stale_index']}, unreadable now: "
        f"{r['acknowledged']['disk']['stale_index_unreadable']}",
        f"- Plain answers equal between the soak's processes and the baseline's: "
        f"{'yes' if r['plain_mismatch_between_processes'] == 0 else 'no: ' + str(r['plain_mismatch_between_processes'])}",
        f"- Namespace isolation: {r['namespace_isolation']['hits_on_another_namespace']} of "
        f"{r['namespace_isolation']['hits_checked']} hits reused an entry of another namespace (must be 0); "
        f"{r['cross_namespace']['n']} pages were asked again in another namespace ({r['cross_namespace']['exact']} "
        "exact hits among them: on the copy stored by an earlier such request)",
        f"- Directory at the end: {r['directory']['named']} blobs indexed, {r['directory']['orphans']} orphan blob "
        f"files ({r['directory']['orphan_bytes'] / 2**20:.1f} MiB: files no index names, e.g. writes cut by "
        f"SIGKILL or written into a replaced index), {r['directory']['quarantine_folders']} quarantined index(es)",
        "", "## Answers against plain transformers, by kind", "",
        "| kind | soak requests | differ from plain | baseline requests | baseline differ | TTFT p50 / p99 ms (soak) "
        "| TTFT p50 / p99 ms (baseline) |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for kind in ("miss", "exact", "approximate"):
        lines.append(f"| {kind} | {k[kind]['n']} | {k[kind]['differ']} | {b[kind]['n']} | {b[kind]['differ']} | "
                     f"{_ms(k[kind]['ttft_p50_ms'])} / {_ms(k[kind]['ttft_p99_ms'])} | "
                     f"{_ms(b[kind]['ttft_p50_ms'])} / {_ms(b[kind]['ttft_p99_ms'])} |")
    lines.append(f"| plain | {k['plain']['n']} | - | {b['plain']['n']} | - | {_ms(k['plain']['ttft_p50_ms'])} / "
                 f"{_ms(k['plain']['ttft_p99_ms'])} | {_ms(b['plain']['ttft_p50_ms'])} / "
                 f"{_ms(b['plain']['ttft_p99_ms'])} |")
    rate = lambda d: d["differ"] / d["n"] if d["n"] else 0.0  # noqa: E731
    lines += ["", f"Misses and exact hits must equal plain (0 differing). Approximate hits differ at "
              f"{rate(k['approximate']):.3f} in the soak against {rate(b['approximate']):.3f} in the baseline "
              "(the policy's own deviation on this random-weight model).", "",
              "## Faults injected and the misses attributed to each", "",
              "A miss is attributed to a fault when the baseline had a hit for that request and the request started "
              "between the fault's start and its end plus the grace window; other extra misses come from the "
              f"processes' interleaving (a page served before another process stored it). Hits where the baseline "
              f"missed: {r['hits_beyond_baseline']}.", "",
              "| fault | injected | extra misses |", "| --- | --- | --- |"]
    for name in sorted(set(r["fault_counts"]) | set(r["extra_misses"])):
        lines.append(f"| {name} | {r['fault_counts'].get(name, 0)} | {r['extra_misses'].get(name, 0)} |")
    lines += ["", "## Processes: RSS and open files (`soak.png`)", "",
              "While serving (first request to last): RSS and open files of each process.", "",
              "| process | worker | served | RSS MiB first / max / last | RSS growth MiB | open files first / max / last |",
              "| --- | --- | --- | --- | --- | --- |"]
    for p in r["processes_over_time"]:
        bd = p.get("bounds")
        if bd is None:
            continue
        lines.append(f"| {p['pid']} | {p.get('worker', '-')} | {p['served']} | {bd['rss_mib_first']:.0f} / "
                     f"{bd['rss_mib_max']:.0f} / {bd['rss_mib_last']:.0f} | {bd['rss_mib_growth']:+.1f} | "
                     f"{bd['fds_first']} / {bd['fds_max']} / {bd['fds_last']} |")
    if r["exception_samples"]:
        lines += ["", "## Exceptions", "", "```", *r["exception_samples"], "```"]
    if any(r["acknowledged"][t]["unreadable_keys"] for t in ("disk", "disk_before_db_faults", "remote")):
        lines += ["", "## Unreadable acknowledged entries", ""]
        for tier in ("disk", "disk_before_db_faults", "remote"):
            for key, why in r["acknowledged"][tier]["unreadable_keys"][:20]:
                lines.append(f"- {tier} {key[:16]}: {why}")
    lines += ["", "## What the store logged (workers' warnings, counted)", ""]
    lines += [f"- {n} x {text}" for text, n in r["worker_log_warnings"].items()]
    return lines


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m vismemo_hf.bench.soak",
                                     description="one worker of `vismemo bench soak` (the driver starts these)")
    parser.add_argument("--worker", required=True, help="the worker's config file (written by the driver)")
    sys.exit(worker(parser.parse_args().worker))
