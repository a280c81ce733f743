#!/bin/sh
# Runs a training command and stops it as soon as nand says the run diverged.
# Use it as a container's entrypoint wrapper (see job.yaml):
#   nand-watchdog.sh torchrun --nproc-per-node 8 train.py
# Exit code: the training command's, or 3 when nand stopped it (the pod fails,
# so the Job's backoffLimit / your scheduler decides what comes next).
set -u
: "${NAND_RUN:?set NAND_RUN (e.g. from the Job's name)}"
: "${NAND_URL:?set NAND_URL, e.g. http://nand-server:8080}"

"$@" &
train_pid=$!

nand wait "$NAND_RUN" --until diverged &
wait_pid=$!

# Whichever ends first decides.
while kill -0 "$train_pid" 2>/dev/null && kill -0 "$wait_pid" 2>/dev/null; do
    sleep 2
done

if ! kill -0 "$wait_pid" 2>/dev/null && wait "$wait_pid"; then
    echo "nand: run $NAND_RUN diverged; stopping the training" >&2
    nand verdict "$NAND_RUN" >&2 || true
    kill -TERM "$train_pid" 2>/dev/null
    sleep 10
    kill -KILL "$train_pid" 2>/dev/null
    exit 3
fi
kill "$wait_pid" 2>/dev/null
wait "$train_pid"
