#!/usr/bin/env bash
# Store benchmark with the shared tier on one local redis-server and on a local 3-master Redis Cluster
# (loopback ports, no persistence), side by side: writes results/store/store.{md,json} (or the folder $1).
set -euo pipefail
out=${1:-results/store}
dir=$(mktemp -d)
ports=(46379 46380 46381 46382)  # one server, then the cluster's three masters (each also on port + 10000)
cleanup() { for p in "${ports[@]}"; do redis-cli -p "$p" shutdown nosave >/dev/null 2>&1 || true; done; rm -rf "$dir"; }
trap cleanup EXIT
redis-server --port "${ports[0]}" --bind 127.0.0.1 --save "" --appendonly no --daemonize yes --dir "$dir" \
    --logfile "$dir/single.log"
for p in "${ports[@]:1}"; do
    redis-server --port "$p" --bind 127.0.0.1 --save "" --appendonly no --daemonize yes --dir "$dir" \
        --cluster-enabled yes --cluster-config-file "nodes-$p.conf" --logfile "$dir/$p.log"
done
sleep 0.5
redis-cli --cluster create $(printf '127.0.0.1:%s ' "${ports[@]:1}") --cluster-replicas 0 --cluster-yes >/dev/null
until [ "$(redis-cli -p "${ports[1]}" cluster info | tr -d '\r' | grep cluster_state)" = "cluster_state:ok" ]; do sleep 0.2; done
vismemo bench store --tokens 1024 --layers 36 --kv-heads 8 --head-dim 128 --embed-dim 4096 --beta 0.1 --warmup 3 \
    --repeats 5 --trace-requests 4000 --capacities 25,50,100,200 --seed 0 \
    --remote "redis://127.0.0.1:${ports[0]}/0" --remote "redis://127.0.0.1:${ports[1]}/0" --out "$out"
