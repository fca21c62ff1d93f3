#!/usr/bin/env bash
# Train the demo model on the lent GPU across several 10-minute device calls (docs/demo_model_training.md).
#
#   bash scripts/device_train.sh start [train_demo_model.py args...]   # call 1: set up, start, wait, pack
#   bash scripts/device_train.sh poll                                  # every later call
#
# The device keeps a machine only ~30 s after a call ends, so a training run outlives a call only when the
# next call comes at once. Every call therefore ends by packing the latest save into $OUT (demo.tar.aa, ...;
# join with `cat demo.tar.* | tar xf -`), and `poll` exits at once (rc 3) on a fresh machine instead of
# waiting for a log that is not there. Needs .dev/ carried in: the pymupdf and loguru wheels, tf.tar.xz
# (transformers 5.24 trimmed to the unlimited_ocr model) and wip.tar.xz (the checkpoint to resume).
set -u
LOG=/tmp/train.log
SAVE=/tmp/demo
WAIT_S=${WAIT_S:-530}

pack() {
    # shards are written in place: while a save is running the log's last line is its "Writing model shards" bar
    for _ in $(seq 20); do tail -n 1 "$LOG" | grep -q 'Writing model shards' || break; sleep 1; done
    cp "$LOG" "$OUT/train.log" 2>/dev/null
    if [ -f "$SAVE/config.json" ]; then
        tar cf - -C "$SAVE" . | split -b 15M - "$OUT/demo.tar."
    fi
}

wait_and_report() {
    local start=$SECONDS
    while [ $((SECONDS - start)) -lt "$WAIT_S" ]; do
        grep -q '^RESULT' "$LOG" && break
        sleep 5
    done
    grep -E '\] (eval|saved)' "$LOG" | tail -n 6
    tail -c 1500 "$LOG"
    grep -q '^RESULT' "$LOG" && echo "TRAINING DONE"
    pack
}

case "${1:-}" in
start)
    shift
    mkdir -p /tmp/site /tmp/wip
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .dev/*.whl || exit 2
    tar xJf .dev/tf.tar.xz -C /tmp/site && tar xJf .dev/wip.tar.xz -C /tmp/wip || exit 2
    cp -r . /tmp/repo
    (cd /tmp/repo && PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 setsid nohup python3 scripts/train_demo_model.py \
        --resume /tmp/wip --out "$SAVE" "$@" > "$LOG" 2>&1 < /dev/null &)
    sleep 2
    wait_and_report
    ;;
poll)
    test -f "$LOG" || { echo "FRESH MACHINE: the training run is lost (the last packed save is what remains)"; exit 3; }
    wait_and_report
    ;;
*)
    echo "usage: $0 start [train args...] | poll" >&2
    exit 64
    ;;
esac
