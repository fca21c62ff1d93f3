"""The calibration ladder's decode job (ingest/calibration/decode.py) and its table (python -m scripts.eval.grades),
with a scripted decoder behind the engine's submit / poll interface: documents are rendered by a real process pool,
the print measured on each page is stored, a page that copies its neighbour in a chunk is read again alone, a
restart goes on where the last run stopped (also between a document and its pages read alone), the time budget
stops the job keeping what is done, and the table runs from the files alone."""

from __future__ import annotations

import json

from ingest.calibration.decode import decode_ladder, read_lines
from scripts.eval import grades
from tests.conftest import DEMO, needs_demo
from tests.ladder_reader import ScriptedLadderReader, key_pages, labels

pytestmark = needs_demo
SEED0 = 600_000  # 600000: 2 sparse pages, 600001: 2 dense scanned pages, 600002: 4 pages


class LadderReader(ScriptedLadderReader):
    """Reads every ladder page as its label, except that in a chunk of several pages the last page is written as a
    copy of the page before it (with more confidence than the rest); a page read alone is read right."""

    model_name = "ladder-reader"

    def read(self, key, n):
        seed, pages = key_pages(key)
        texts = [labels(seed)[p - 1] for p in pages]
        assert len(texts) == n
        if n > 1:
            texts[-1] = texts[-2]
        return [(text, -0.01 if n > 1 and i == n - 1 else -0.05) for i, text in enumerate(texts)]


def test_the_ladder_job_decodes_repairs_resumes_and_tables(tmp_path):
    folder = tmp_path / "ladder"
    reader = LadderReader()
    rec = decode_ladder(folder, str(DEMO), 3, SEED0, procs=1, decoder=reader)
    assert rec["this_run"]["documents"] == 3 and rec["this_run"]["stopped"] is None
    assert rec["in_folder"] == {"documents": 3, "pages": 8, "held_out_pages": 2, "read_alone": rec["this_run"]["alone"]}
    docs = {d["seed"]: d for d in read_lines(folder / "decoded.jsonl")}
    assert sorted(docs) == [600000, 600001, 600002]
    for seed, d in docs.items():
        assert d["labels"] == labels(seed) and d["half"] == ("held_out" if seed % 2 else "labelled")
        assert len(d["ink"]) == len(d["image_size"]) == d["rung"]["pages"]
        assert all(ink["ink_chars"] > 20 for ink in d["ink"])  # the print was measured on every page
        assert [(c["first"], c["last"]) for c in d["chunks"]] == [(1, d["rung"]["pages"])]
    # the copied last page of every chunk was read alone (others too, where the loose text-vs-ink check caught them)
    alone = {r["key"] for r in read_lines(folder / "repaired.jsonl")}
    assert {"600000:2", "600001:2", "600002:4"} <= alone
    assert len(alone) == rec["this_run"]["alone"]

    # a restart: nothing left to do
    again = decode_ladder(folder, str(DEMO), 3, SEED0, procs=1, decoder=LadderReader())
    assert again["this_run"]["documents"] == again["this_run"]["alone"] == 0
    # stopped between the documents and their pages read alone: a restart reads those pages alone again
    (folder / "repaired.jsonl").unlink()
    again = decode_ladder(folder, str(DEMO), 3, SEED0, procs=1, decoder=LadderReader())
    assert again["this_run"]["documents"] == 0 and again["this_run"]["alone"] == len(alone)
    assert {r["key"] for r in read_lines(folder / "repaired.jsonl")} == alone
    # the time budget stops the job and keeps what is done
    stopped = decode_ladder(folder, str(DEMO), 5, SEED0, procs=1, budget_s=1e-6, decoder=LadderReader())
    assert stopped["this_run"]["stopped"] and stopped["in_folder"]["documents"] == 3
    assert len(read_lines(folder / "runs.jsonl")) == 4

    # the table, from the files alone (no pages rendered: the print measured is in the file)
    rows_path, json_path = tmp_path / "rows.jsonl", tmp_path / "grades.json"
    assert grades.main(["table", "--dir", str(folder), "--model", str(DEMO), "--rows", str(rows_path),
                        "--json", str(json_path)]) == 0
    rows = read_lines(rows_path)
    assert len(rows) == 8 and all(r["cer"] == 0.0 for r in rows)  # every copy replaced by its reading alone
    copies = {(r["seed"], r["page"]): r["repair"] for r in rows if (r["seed"], r["page"]) in
              {(600000, 2), (600001, 2), (600002, 4)}}
    assert all(rep["kept"] == "alone" and "repeats_page" in rep["checks"] for rep in copies.values()), copies
    record = json.loads(json_path.read_text(encoding="utf-8"))
    assert record["command"].startswith("python -m scripts.eval.grades table")
    assert record["documents"] == 3 and record["decoded_on"]["device"] == "cpu"
    assert record["halves"]["held_out"]["pages"] == 2 and record["halves"]["labelled"]["pages"] == 6
    assert record["repairs"]["kept_alone"] >= 3 and record["repairs"]["caught_without_reading_alone"] == 0
