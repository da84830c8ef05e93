#!/usr/bin/env bash
# Start the Ray head of a pagedserve cluster on this machine.
#
#   deploy/scripts/start_head.sh                 # GCS on 6379, dashboard/job server on 8265
#   NODE_IP=10.0.0.10 IFNAME=ens5 deploy/scripts/start_head.sh --num-gpus 8
#
# NODE_IP: the address other nodes reach this one on (default: the first address `hostname -I`
#   prints; set it on hosts with several NICs). pagedserve binds NCCL/gloo to the interface that
#   carries it; IFNAME overrides that choice for every process on this node.
# Token authentication is on (RAY_AUTH_MODE=token unless you set it): the first start makes the
#   cluster's token, ~/.ray/auth_token; copy that file to every other node and to every machine
#   that submits jobs (or pass its contents as RAY_AUTH_TOKEN). See deploy/README.md.
# Extra arguments go to `ray start` unchanged.
set -euo pipefail

RAY_PORT="${RAY_PORT:-6379}"
DASHBOARD_PORT="${DASHBOARD_PORT:-8265}"
NODE_IP="${NODE_IP:-$(hostname -I | awk '{print $1}')}"

if [[ -n "${IFNAME:-}" ]]; then
    # Exported before `ray start`, so every worker process Ray spawns on this node inherits them.
    export NCCL_SOCKET_IFNAME="$IFNAME" GLOO_SOCKET_IFNAME="$IFNAME"
fi

# Ray starts worker processes at nice 15; a pagedserve rank is the node's work, and at nice 15
# its torch threads lose their cores to every daemon wake-up. Exported before `ray start`.
export RAY_worker_niceness="${RAY_worker_niceness:-0}"

# Exported before `ray start`: the raylet, and every process it starts, authenticates with it.
export RAY_AUTH_MODE="${RAY_AUTH_MODE:-token}"
if [[ "$RAY_AUTH_MODE" == token && -z "${RAY_AUTH_TOKEN:-}" && -z "${RAY_AUTH_TOKEN_PATH:-}" \
      && ! -s "$HOME/.ray/auth_token" ]]; then
    ray get-auth-token --generate >/dev/null
    echo "made the cluster's token: $HOME/.ray/auth_token (copy it to every node and job submitter)"
fi

ulimit -n 65536 || true
ray start --head \
    --port="$RAY_PORT" \
    --node-ip-address="$NODE_IP" \
    --dashboard-host=0.0.0.0 \
    --dashboard-port="$DASHBOARD_PORT" \
    "$@"

echo
echo "head is up at ${NODE_IP}:${RAY_PORT} (dashboard and job server: http://${NODE_IP}:${DASHBOARD_PORT})"
echo "on each worker:  HEAD=${NODE_IP} deploy/scripts/start_worker.sh"
echo "then wait:       python deploy/scripts/wait_for_nodes.py --nodes N [--gpus G]"
