#!/bin/sh
# Runs a training command and stops it as soon as nand says the run diverged.
# Use it as a container's entrypoint wrapper (see job.yaml):
#   nand-watchdog.sh torchrun --nproc-per-node 8 train.py
# Exit code: the training command's, or 3 when nand stopped it (the pod fails,
# so the Job's backoffLimit / your scheduler decides what comes next).
set -u
: "${NAND_RUN:?set NAND_RUN (e.g. from the Job's name)}"
: "${NAND_URL:?set NAND_URL, e.g. http://nand-server:8080}"

# A re-applied Job keeps its name, hence its run id: the server makes it a new
# attempt of the run, and --launch (the Job's uid, NAND_LAUNCH in job.yaml) has
# the wait ignore the last attempt's "diverged" until this launch says hello.
nand wait "$NAND_RUN" --until diverged ${NAND_LAUNCH:+--launch "$NAND_LAUNCH"} &
wait_pid=$!

"$@" &
train_pid=$!

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
