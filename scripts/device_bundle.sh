#!/usr/bin/env bash
# What a call to the GPU machine needs beside the tree, built into .dev/ (ignored through .git/info/exclude):
# the wheels its image lacks (loguru, pymupdf, the ledger's sqlalchemy/pydantic/watchdog; transformers 5.24, the
# first with Unlimited-OCR: the image has 5.17) for its Python 3.12, and the demo model as one xz archive. The tree travels with a 64 MiB limit and models/demo
# alone is 51 MiB, so a call moves models/demo out of the tree first and carries .dev (see the printed recipe).
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.dev/' .git/info/exclude 2>/dev/null || echo '/.dev/' >> .git/info/exclude
mkdir -p .dev
if [ ! -f .dev/site.tar.xz ]; then  # the wheels, unpacked and xz-compressed together (74 MB as wheels, too big)
    tmp=$(mktemp -d)
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform any -d "$tmp/wheels" loguru==0.7.3 pymupdf==1.26.7 transformers==5.24.0 sqlalchemy==2.0.44 \
        pydantic==2.12.5 pydantic-core==2.41.5 pydantic-settings==2.12.0 python-dotenv==1.2.1 \
        typing-inspection==0.4.2 annotated-types==0.7.0 watchdog==6.0.0
    for w in "$tmp"/wheels/*.whl; do python3 -m zipfile -e "$w" "$tmp/site"; done
    tar -cJf .dev/site.tar.xz -C "$tmp/site" .
    rm -rf "$tmp"
fi
[ -f .dev/demo.tar.xz ] || tar -cJf .dev/demo.tar.xz -C models/demo .
du -ch .dev/* | tail -n 1
cat <<'RECIPE'
Per call: here `mv models/demo /tmp/demo_hold` (back afterwards: `mv /tmp/demo_hold models/demo`), then run with
carry [".dev"] and a command that starts:
  mkdir -p /tmp/site models/demo && tar -xJf .dev/site.tar.xz -C /tmp/site &&
  tar -xJf .dev/demo.tar.xz -C models/demo && export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 && ...
RECIPE
