#!/usr/bin/env bash
# What an offline GPU machine needs beside the tree, built into .dev/ (ignored through .git/info/exclude), for a
# Python 3.12 image with torch, triton, Pillow and psutil but a transformers too old for Unlimited-OCR:
#   site_core.tar.xz  transformers 5.24 cut to the model folders Unlimited-OCR imports, loguru, sqlalchemy, pydantic,
#                     pydantic-settings, watchdog, rapidfuzz, pytest (~8 MB)
#   site_pdf.tar.xz   pymupdf, for calls that render PDFs (the pipeline) (~18 MB)
#   site_extra.tar.xz lxml and tqdm, for calls that run `uflash run` with ALTO output (~3 MB)
#   demo.tar.xz       models/demo with its drafter stored in bf16 for the trip (the engine casts it to the model's
#                     dtype anyway) (~33 MB)
# When the tree may be copied there only up to 64 MiB (models/demo alone is 51 MiB), move models/demo out of the
# tree first and copy .dev with it (the recipe is printed at the end).
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.dev/' .git/info/exclude 2>/dev/null || echo '/.dev/' >> .git/info/exclude
mkdir -p .dev
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
download() {
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform any -d "$tmp/wheels" "$@"
}
if [ ! -f .dev/site_core.tar.xz ]; then
    download transformers==5.24.0 loguru==0.7.3 sqlalchemy==2.0.44 pydantic==2.12.5 pydantic-core==2.41.5 \
        pydantic-settings==2.12.0 python-dotenv==1.2.1 typing-inspection==0.4.2 annotated-types==0.7.0 \
        watchdog==6.0.0 rapidfuzz==3.14.6 pytest==8.4.2 pluggy==1.6.0 iniconfig==2.1.0
    for w in "$tmp"/wheels/*.whl; do python3 -m zipfile -e "$w" "$tmp/core"; done
    keep="auto unlimited_ocr deepseek_ocr2 got_ocr2 clip sam deepseek_v2 deepseek_v3 llama deepseek_vl
          deepseek_vl_hybrid siglip qwen2 encoder_decoder"
    for d in "$tmp"/core/transformers/models/*/; do
        name=$(basename "$d"); case " $(echo $keep) " in *" $name "*) ;; *) rm -rf "$d" ;; esac
    done
    tar -cJf .dev/site_core.tar.xz -C "$tmp/core" .
    rm -rf "$tmp/wheels"
fi
if [ ! -f .dev/site_pdf.tar.xz ]; then
    download pymupdf==1.26.7
    python3 -m zipfile -e "$tmp"/wheels/pymupdf-*.whl "$tmp/pdf"
    tar -cJf .dev/site_pdf.tar.xz -C "$tmp/pdf" .
fi
if [ ! -f .dev/site_extra.tar.xz ]; then  # lxml (ALTO, hOCR) and tqdm (run progress), for `uflash run` there
    download lxml==6.2.0 tqdm==4.70.1
    for w in "$tmp"/wheels/lxml-*.whl "$tmp"/wheels/tqdm-*.whl; do python3 -m zipfile -e "$w" "$tmp/extra"; done
    tar -cJf .dev/site_extra.tar.xz -C "$tmp/extra" .
fi
if [ ! -f .dev/demo.tar.xz ]; then
    cp -r models/demo "$tmp/demo"
    python3 - "$tmp/demo/drafter/drafter.safetensors" <<'PY'
import sys, torch
from safetensors.torch import load_file, save_file
path = sys.argv[1]
save_file({k: v.to(torch.bfloat16) for k, v in load_file(path).items()}, path)
PY
    tar -cJf .dev/demo.tar.xz -C "$tmp/demo" .
fi
du -ch .dev/*.tar.xz | tail -n 1
cat <<'RECIPE'
Each time: here `mv models/demo /tmp/demo_hold` (back afterwards: `mv /tmp/demo_hold models/demo`), copy the tree
with .dev to the GPU machine, and start the command there with:
  mkdir -p /tmp/site models/demo && tar -xJf .dev/site_core.tar.xz -C /tmp/site &&
  tar -xJf .dev/site_pdf.tar.xz -C /tmp/site && tar -xJf .dev/site_extra.tar.xz -C /tmp/site &&
  tar -xJf .dev/demo.tar.xz -C models/demo &&
  export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 && ...
RECIPE
