"""The stand-in model (`scripts.standin`) at a tiny size: made by the same code as the full-size one, loaded by
``uflash run`` through ``model.path``, it writes the planted shape: N distinct words a page, the pages of a chunk
split where ``<PAGE>`` stands, EOS at the end (every page finished), no word twice (the no-repeat rule never
fires)."""

from __future__ import annotations

import json

from tests.conftest import uflash, worker_config

TOKENS = 20  # a page's words (the tiny config's R-SWA window is 16)


def test_tiny_standin_through_uflash_run(tmp_path):
    from scripts.standin import build_standin

    model = tmp_path / "standin"
    desc = build_standin(model, tokens_per_page=TOKENS, max_pages=3, tiny=True)
    assert desc["pages"] == 3 and (model / "standin.json").is_file()
    from ingest.synth.documents import make_document

    (tmp_path / "in").mkdir()
    three, one = tmp_path / "in" / "three.pdf", tmp_path / "in" / "one.pdf"
    three.write_bytes(make_document(873_001, 3, scan=True)[0])  # full pages: no review re-reads a page alone
    one.write_bytes(make_document(873_002, 1, scan=True)[0])
    cfg = worker_config(tmp_path, model, engine={"mode": "plain", "max_pages_per_chunk": 3, "max_tokens_per_page": 30,
                                                 "max_batch": 2},
                        quality={"repair": False})  # no page read again alone: each chunk's reading stays
    r = uflash("--config", str(cfg), "run", str(three), str(one), timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    words = []
    for name, n in (("three", 3), ("one", 1)):
        meta = json.loads((tmp_path / "outbox" / name / "document.json").read_text(encoding="utf-8"))
        pages = [p["text"].split() for p in meta["pages"]]
        assert [len(p) for p in pages] == [TOKENS] * n, [p[:3] for p in pages]
        assert not any("<PAGE>" in w or "end▁of▁sentence" in w for p in pages for w in p)
        assert [p["stats"]["finish_reason"] for p in meta["pages"]] == ["page_separator"] * (n - 1) + ["eos"]
        words += [w for p in pages for w in p]
    assert len(set(words[: 3 * TOKENS])) == 3 * TOKENS  # the 3-page chunk repeats no word
    assert words[3 * TOKENS:] == words[:TOKENS]  # a chunk starts on the same planted path
