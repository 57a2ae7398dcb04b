#!/usr/bin/env bash
# The speech chat on one GPU (bench/gpu_speech_chat.py), from the repository root, in the device
# call that carries the last of .gpu/speech_chat.parts/ (python -m bench.speech_chat_pack): the
# parts are checked against their SHA256SUMS, unpacked once into $SPEECH_CHAT_WORK, the pack's
# wheels installed, then every part of the run.
#   bash bench/gpu_speech_chat.sh [--minutes 3] [--parts base,chat,no_text,baseline]
#   bash bench/gpu_speech_chat.sh --cpu --data DIR      # reduced, on the CPU (what CI runs)
set -euo pipefail
cd "$(dirname "$0")/.."
PARTS=${SPEECH_CHAT_PARTS:-.gpu/speech_chat.parts}
WORK=${SPEECH_CHAT_WORK:-/tmp/speech_chat}
PACK_ARGS=()
if [[ " $* " != *" --cpu "* ]]; then
    if [ ! -f "$WORK/speech_chat/anchor.json" ]; then
        if [ ! -f "$PARTS/SHA256SUMS" ]; then
            echo "error: $PARTS/SHA256SUMS is missing: run python -m bench.speech_chat_pack where there is network, and carry its parts" >&2
            exit 2
        fi
        for part in $(awk '{print $2}' "$PARTS/SHA256SUMS"); do
            if [ ! -f "$PARTS/$part" ]; then
                echo "error: $PARTS/$part is missing: carry each part in its own call, back to back (a machine that went back keeps no files: start again from the first part)" >&2
                exit 2
            fi
        done
        if ! (cd "$PARTS" && sha256sum --quiet -c SHA256SUMS); then
            echo "error: a part in $PARTS is not the one packed (sha256): carry it again" >&2
            exit 2
        fi
        mkdir -p "$WORK"
        cat "$PARTS"/part-* | tar -x -C "$WORK"
    fi
    WHEELS=$WORK/speech_chat/wheels
    PACK_ARGS=(--pack "$WORK/speech_chat")
fi
source bench/gpu_env.sh
exec "$PYTHON" -m bench.gpu_speech_chat "${PACK_ARGS[@]}" "$@"
