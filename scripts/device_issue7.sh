#!/usr/bin/env bash
# Issue 7's GPU measurements on the lent H200: every block-drafter variant's live check against plain, side by
# side, then the small-linear profile and the CUDA exactness tests. Everything lands in $OUT/r (one JSON per
# variant, logs). Prepare here first (the tree travels with a 64 MiB limit):
#
#   bash scripts/device_bundle.sh && mv models/demo /tmp/demo_hold
#   run: "STAGES=variants bash scripts/device_issue7.sh", carry [".dev"]      (~4-5 minutes)
#   run: "STAGES='profile tests' bash scripts/device_issue7.sh", carry [".dev"]
#   then here: mv /tmp/demo_hold models/demo
#
# VARIANTS (env, ';'-separated train_drafter.py flag sets) overrides the list below; DRAFTER=<folder in the tree>
# checks another drafter than models/demo/drafter (e.g. one made by a CPU fine-tune, carried beside .dev);
# EVAL_PAGES (default 30) sets the held-out pages of each live check; STAGES (default "variants profile tests")
# picks what runs (the four default variants take ~4-5 minutes; session 14 measured --compile-draft, --draft-linear bmv,
# --attn matmul_t: none faster).
# STAGES=train (a call of its own, ~8-9 minutes): MINUTES (default 4) more training of models/demo/drafter on 2,000
# new pages (PAGE_SEED, default 1300000), then its live check with device drafts (the default) and with
# --host-drafts; the new drafter lands in $OUT/drafter (ship it as models/demo/drafter if it beats the old one).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
mkdir -p /tmp/site models/demo "$OUT/r"
tar -xJf .dev/site.tar.xz -C /tmp/site && tar -xJf .dev/demo.tar.xz -C models/demo || exit 2
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/r/gpu.txt"
VARIANTS=${VARIANTS:-"; --host-drafts; --no-sit-out; --block-full-k --no-sit-out"}
STAGES=${STAGES:-"variants profile tests"}
INIT=()
[ -n "${DRAFTER:-}" ] && INIT=(--init "$DRAFTER")
IFS=';' read -ra FLAGS <<< "$VARIANTS"
[[ $STAGES == *variants* ]] || FLAGS=()
for v in "${FLAGS[@]}"; do
    name=eval$(echo "$v" | tr -dc 'a-z_-' | tr '-' '_')
    echo "== variant:${v:- (default)} -> $name"
    # shellcheck disable=SC2086  # the flags are meant to split
    python scripts/train_drafter.py --model models/demo --dtype float32 --eval-only --eval-pages "${EVAL_PAGES:-30}" --workers 8 "${INIT[@]}" $v \
        --json "$OUT/r/$name.json" > "$OUT/r/$name.log" 2>&1
    tail -n 3 "$OUT/r/$name.log" | head -n 2
done
if [[ $STAGES == *train* ]]; then
    python scripts/train_drafter.py --model models/demo --dtype float32 --init models/demo/drafter \
        --page-seed "${PAGE_SEED:-1300000}" --pages 2000 --multi-frac 0.5 --multi-pages 4 --minutes "${MINUTES:-4}" \
        --workers 15 --batch 512 --anchors 16 --lr 5e-4 --heldout-pages 30 --eval-pages 30 --out "$OUT/drafter" \
        --json "$OUT/r/train.json" > "$OUT/r/train.log" 2>&1
    grep -a "held-out tau" "$OUT/r/train.log" | tail -n 2
    tail -n 3 "$OUT/r/train.log" | head -n 2 | cut -c1-300
    python scripts/train_drafter.py --model models/demo --dtype float32 --eval-only --init "$OUT/drafter" \
        --eval-pages 30 --workers 15 --host-drafts --json "$OUT/r/train_eval_host_drafts.json" \
        > "$OUT/r/train_eval_host_drafts.log" 2>&1
    tail -n 3 "$OUT/r/train_eval_host_drafts.log" | head -n 2
fi
[[ $STAGES == *profile* ]] && python scripts/profile_linear.py --shapes 768x256,256x256,1024x256,256x1024,256x1152 --widths 8,32,40 \
    --json "$OUT/r/profile_linear.json" > "$OUT/r/profile_linear.log" 2>&1
[[ $STAGES == *profile* ]] && tail -n 12 "$OUT/r/profile_linear.log" | head -n 11
[[ $STAGES == *tests* ]] && python -m pytest -q tests/test_static_exact.py tests/test_block_drafter.py -k "cuda or static" \
    > "$OUT/r/pytest_cuda.log" 2>&1
[[ $STAGES == *tests* ]] && tail -n 2 "$OUT/r/pytest_cuda.log"
exit 0
