#!/usr/bin/env bash
# Join this machine to a running pagedserve Ray cluster.
#
#   HEAD=10.0.0.10 deploy/scripts/start_worker.sh
#   HEAD=10.0.0.10 NODE_IP=10.0.0.11 IFNAME=ens5 deploy/scripts/start_worker.sh --num-gpus 8
#   HEAD=10.0.0.10 deploy/scripts/start_worker.sh --block     # stay in the foreground (systemd)
#
# The worker must run the same Python and Ray versions as the head (use the same image).
set -euo pipefail

: "${HEAD:?set HEAD to the head node address, e.g. HEAD=10.0.0.10}"
RAY_PORT="${RAY_PORT:-6379}"
NODE_IP="${NODE_IP:-$(hostname -I | awk '{print $1}')}"

if [[ -n "${IFNAME:-}" ]]; then
    export NCCL_SOCKET_IFNAME="$IFNAME" GLOO_SOCKET_IFNAME="$IFNAME"
fi

ulimit -n 65536 || true
ray start --address="${HEAD}:${RAY_PORT}" --node-ip-address="$NODE_IP" "$@"
