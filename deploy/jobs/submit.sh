#!/usr/bin/env bash
# Submit a batch generate job to a running Ray cluster.
#
#   deploy/jobs/submit.sh DATA_DIR [RESULTS_PATH]
#
# DATA_DIR holds prompts.jsonl; it is shipped to the cluster as the job's working dir.
# RESULTS_PATH is where the node running the job writes results: use shared storage (NFS, a
# PVC), because a relative path lands in the job's temporary copy of DATA_DIR and is lost.
# Rerunning the same command resumes: ids already in RESULTS_PATH are skipped.
#
# RAY_ADDRESS: the job server (default http://127.0.0.1:8265, i.e. on the head, or through
# `ray dashboard cluster.yaml` / `kubectl port-forward svc/...-head-svc 8265`).
set -euo pipefail

DATA_DIR="${1:?usage: submit.sh DATA_DIR [RESULTS_PATH]}"
RESULTS="${2:-/data/results/prompts.out.jsonl}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export RAY_ADDRESS="${RAY_ADDRESS:-http://127.0.0.1:8265}"
# The job server checks Ray's token: the cluster's ~/.ray/auth_token copied here, or
# RAY_AUTH_TOKEN (deploy/README.md, "Token authentication").
export RAY_AUTH_MODE="${RAY_AUTH_MODE:-token}"

cd "$DATA_DIR"
ray job submit \
    --working-dir . \
    --runtime-env "$HERE/runtime_env.yaml" \
    --entrypoint-num-cpus 1 \
    -- pagedserve generate --address auto --model /models/Qwen2.5-7B-Instruct --tp 4 \
       --input prompts.jsonl --output "$RESULTS" --max-tokens 128 --temperature 0.0
