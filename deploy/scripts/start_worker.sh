#!/usr/bin/env bash
# Join this machine to a running pagedserve Ray cluster.
#
#   HEAD=10.0.0.10 deploy/scripts/start_worker.sh
#   HEAD=10.0.0.10 NODE_IP=10.0.0.11 IFNAME=ens5 deploy/scripts/start_worker.sh --num-gpus 8
#   HEAD=10.0.0.10 deploy/scripts/start_worker.sh --block     # stay in the foreground (systemd)
#
# The worker must run the same Python and Ray versions as the head (use the same image), and hold
# the cluster's token: the head's ~/.ray/auth_token copied to ~/.ray/auth_token here, or its
# contents in RAY_AUTH_TOKEN (RAY_AUTH_MODE=token unless you set it; see deploy/README.md).
set -euo pipefail

: "${HEAD:?set HEAD to the head node address, e.g. HEAD=10.0.0.10}"
RAY_PORT="${RAY_PORT:-6379}"
NODE_IP="${NODE_IP:-$(hostname -I | awk '{print $1}')}"

if [[ -n "${IFNAME:-}" ]]; then
    export NCCL_SOCKET_IFNAME="$IFNAME" GLOO_SOCKET_IFNAME="$IFNAME"
fi

# Workers at normal priority, as on the head (see start_head.sh).
export RAY_worker_niceness="${RAY_worker_niceness:-0}"
export RAY_AUTH_MODE="${RAY_AUTH_MODE:-token}"
if [[ "$RAY_AUTH_MODE" == token && -z "${RAY_AUTH_TOKEN:-}" && -z "${RAY_AUTH_TOKEN_PATH:-}" \
      && ! -s "$HOME/.ray/auth_token" ]]; then
    echo "no Ray auth token on this node: copy the head's ~/.ray/auth_token to $HOME/.ray/auth_token," >&2
    echo "or set RAY_AUTH_TOKEN to its contents (RAY_AUTH_MODE=disabled: a head started without auth)" >&2
    exit 2
fi

ulimit -n 65536 || true
ray start --address="${HEAD}:${RAY_PORT}" --node-ip-address="$NODE_IP" "$@"
