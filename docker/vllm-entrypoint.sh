#!/bin/sh
# Entry point of docker/Dockerfile.vllm. With RAGEN_VLLM_MODEL set (a model path, e.g. on the
# /scratch emptyDir, or a hub id with HF_HUB_OFFLINE=0), start `vllm serve` from its own venv on
# 127.0.0.1, wait until /health answers, export RAGEN_VLLM_BASE_URL, run the given command (the
# Prefect flow run) and stop the server when it ends. Without it, just run the command.
set -eu

if [ -z "${RAGEN_VLLM_MODEL:-}" ]; then
    exec "$@"
fi

port="${RAGEN_VLLM_PORT:-8000}"
timeout_s="${RAGEN_VLLM_STARTUP_TIMEOUT_S:-900}"
# RAGEN_VLLM_ARGS is split on spaces on purpose (extra `vllm serve` flags).
# shellcheck disable=SC2086
/opt/vllm/bin/vllm serve "$RAGEN_VLLM_MODEL" --host 127.0.0.1 --port "$port" ${RAGEN_VLLM_ARGS:-} &
vllm_pid=$!
trap 'kill "$vllm_pid" 2>/dev/null || true' EXIT INT TERM

waited=0
until /opt/vllm/bin/python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$port/health', timeout=2)" 2>/dev/null; do
    if ! kill -0 "$vllm_pid" 2>/dev/null; then
        echo "ragen-vllm-entrypoint: vllm serve exited before it became healthy (see its log above)" >&2
        exit 1
    fi
    if [ "$waited" -ge "$timeout_s" ]; then
        echo "ragen-vllm-entrypoint: vllm serve not healthy after ${timeout_s}s; raise RAGEN_VLLM_STARTUP_TIMEOUT_S" >&2
        exit 1
    fi
    sleep 1
    waited=$((waited + 1))
done

export RAGEN_VLLM_BASE_URL="http://127.0.0.1:$port/v1"
status=0
"$@" || status=$?
exit "$status"
