"""Choosing a model's grading thresholds on the labelled half of the decoded ladder (ingest.calibration.decode) and
measuring them on the held-out half: every page graded as the pipeline grades it (its figures, the repair of caught
pages with their readings alone, ``ingest.quality.grades.grade_document``, without the text layer), with its CER to
the truth (Levenshtein distance of the plain texts, over the truth's length).

``fit`` chooses the poor rules first (the most precise set whose recall of pages with CER > 0.10 is at least
``RECALL_MARGIN``), then the fair rules (the most pages left ``good`` with a median CER of at most 0.02 and at most 5%
of them above 0.10); ties go to the middle of the tied thresholds.
"""

from __future__ import annotations

from ingest.calibration.decode import INK_LONG_GRID, INK_SHORT_GRID, alone_key, chunk_outputs, page_images

RECALL_MARGIN = 0.93  # the poor rules' recall on the labelled half (a margin over the 0.9 asked on the held-out half)


def graded_pages(docs: list[dict], alone: dict[str, dict], t, tokenizer, repair: bool = True) -> list[dict]:
    """Every page of the ladder as the pipeline grades it: its figures (ingest.quality.repair.chunk_page_stats), the
    repair of caught pages with their single-page readings (``alone``; a page without one is left as it was), the
    document's grade (ingest.quality.grades.grade_document); with its CER to the truth. A caught page without a reading
    alone is left as it was and marked ``"repair": {"kept": "no reading alone"}``."""
    from engine.chunk_output import PageOutput
    from ingest.quality.grades import checks, grade_document, plain_text
    from ingest.quality.measures import character_error_rate
    from ingest.quality.repair import chunk_page_stats, repair_chunk
    from ingest.synth.documents import strip_markup

    rows = []
    for doc in docs:
        images = page_images(doc)
        layers = [None] * len(images)  # graded without the text layer (a grade never depends on it)
        pages: dict[int, tuple] = {}
        for first, out in chunk_outputs(doc):
            span = slice(first - 1, first - 1 + out.n_input_pages)
            imgs = images[span]
            stats = chunk_page_stats(out, imgs, layers[span], tokenizer, t, first,
                                     inks=doc["ink"][span] if doc.get("ink") else None)
            unread: list[int] = []

            def decode_alone(i: int, first=first, doc=doc, unread=unread):
                from engine.chunk_output import ChunkOutput

                rec = alone.get(alone_key(doc["seed"], first + i))
                if rec is None:
                    unread.append(i)
                    return ChunkOutput(pages=[], n_input_pages=1, finish_reason="eos")
                po = PageOutput(text=rec["text"], boxes=[], stats=rec["stats"], ids=rec["ids"],
                                logprobs=rec["logprobs"])
                return ChunkOutput(pages=[po], n_input_pages=1, finish_reason=rec["stats"]["finish_reason"])

            if repair:
                repair_chunk(out, stats, imgs, layers[span], decode_alone, tokenizer, t, first)
                for i in unread:
                    stats[i]["repair"] = {"checks": checks(stats[i]["quality"], t), "kept": "no reading alone"}
            for i, (po, st) in enumerate(zip(out.pages, stats)):
                pages[first + i] = (po, st, first)
        order = sorted(pages)
        graded = grade_document([{**pages[k][1]["quality"], "plain": plain_text(pages[k][0].text),
                                  "chunk_id": pages[k][2]} for k in order], t)
        for k, q in zip(order, graded):
            po, st, _ = pages[k]
            label = doc["labels"][k - 1]
            rows.append({"seed": doc["seed"], "page": k, "half": doc["half"], "rung": doc["rung"],
                         "cer": round(character_error_rate(po.text, label), 4), "truth_chars": len(strip_markup(label)),
                         "grade": q["grade"], "reasons": q["reasons"], "quality": q, "text": po.text,
                         "word_confidence": st.get("word_confidence"),
                         "repair": {k2: v for k2, v in (st.get("repair") or {}).items() if k2 in ("checks", "kept")}})
        missing = [k for k in range(1, doc["rung"]["pages"] + 1) if k not in pages]
        for k in missing:  # a page no chunk returned (cannot happen with the worker's rules; counted if it does)
            rows.append({"seed": doc["seed"], "page": k, "half": doc["half"], "rung": doc["rung"], "cer": 1.0,
                         "grade": "missing", "reasons": [], "quality": {}})
    return rows


def summary(rows: list[dict], cut: float = 0.10) -> dict:
    import statistics

    def q(xs, f):
        xs = sorted(xs)
        return round(xs[min(len(xs) - 1, int(f * len(xs)))], 4) if xs else None

    out = {"pages": len(rows), "bad_pages": sum(r["cer"] > cut for r in rows), "grades": {}}
    for g in ("good", "fair", "poor", "missing"):
        cers = [r["cer"] for r in rows if r["grade"] == g]
        if cers:
            out["grades"][g] = {"pages": len(cers), "cer_median": q(cers, 0.5), "cer_p90": q(cers, 0.9),
                                "cer_mean": round(statistics.fmean(cers), 4),
                                f"share_cer_over_{cut}": round(sum(c > cut for c in cers) / len(cers), 4)}
    bad = [r for r in rows if r["cer"] > cut]
    poor = [r for r in rows if r["grade"] == "poor"]
    out["recall_poor"] = round(sum(r["grade"] == "poor" for r in bad) / len(bad), 4) if bad else None
    out["precision_poor"] = round(sum(r["cer"] > cut for r in poor) / len(poor), 4) if poor else None
    out["good_cer_median"] = out["grades"].get("good", {}).get("cer_median")
    out["bad_graded_good"] = sum(r["grade"] == "good" for r in bad)
    return out


def regrade(rows: list[dict], t) -> list[dict]:
    """The rows graded again with thresholds ``t`` (the figures that depend on them recomputed)."""
    from ingest.quality.grades import grade

    out = []
    for r in rows:
        q = dict(r["quality"])
        conf = [c for c in (r.get("word_confidence") or []) if c is not None]
        if conf:
            q["unsure_words"] = sum(c < t.unsure_word_prob for c in conf) / len(conf)
        g, reasons = grade(q, t) if r["grade"] != "missing" else ("missing", [])
        out.append({**r, "grade": g, "reasons": reasons})
    return out


def middle(candidates: list, score) -> object:
    """Of the candidates (Thresholds) that share the best score, the one in the middle of them: each searched field
    at the median of its tied values (a threshold in the middle of the gap between good and bad pages, not at its
    edge), when that combination scores as well; else the first tied candidate."""
    from dataclasses import fields, replace

    best = max(score(t) for t in candidates)
    tied = [t for t in candidates if score(t) == best]
    names = [f.name for f in fields(tied[0]) if len({getattr(t, f.name) for t in tied}) > 1]
    middle = replace(tied[0], **{n: sorted(getattr(t, n) for t in tied)[len(tied) // 2] for n in names})
    return middle if score(middle) == best else tied[len(tied) // 2]


def fit(rows: list[dict], base) -> tuple:
    """Thresholds chosen on ``rows`` (the labelled half): the poor rules first, the most precise set whose recall of
    pages with CER > 0.10 is >= 0.93 (a margin over the 0.9 asked), then the fair rules, the most pages left good whose
    median CER is <= 0.02 and of which at most 5% are above 0.10; ties broken by the middle of the tied thresholds."""
    import itertools
    from dataclasses import replace

    def poor_score(t):
        s = summary(regrade(rows, t))
        if s["recall_poor"] is None or s["recall_poor"] < RECALL_MARGIN:
            return (-1.0, 0.0)
        return (s["precision_poor"] or 0.0, s["recall_poor"])

    candidates = [replace(base, unsure_word_prob=wp, unsure_words_poor=up, mean_logprob_poor=lp, ink_short=ishort,
                          ink_long=ilong, unsure_words_fair=up, mean_logprob_fair=lp, ink_short_fair=ishort,
                          ink_long_fair=ilong)
                  for wp, up, lp, ishort, ilong in itertools.product(
                      (0.1, 0.2, 0.3, 0.5), (0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.6, 0.8),
                      (-0.05, -0.1, -0.15, -0.2, -0.3, -0.4, -0.6, -0.8, -1.0, -1.5), INK_SHORT_GRID,
                      INK_LONG_GRID)]
    scores = {id(t): poor_score(t) for t in candidates}
    poor_t = middle(candidates, lambda t: scores.get(id(t)) or poor_score(t))

    def fair_score(t):
        good = summary(regrade(rows, t))["grades"].get("good")
        if not good or good["cer_median"] > 0.02 or good["share_cer_over_0.1"] > 0.05:
            return (-1, 0.0)
        return (good["pages"], -good["share_cer_over_0.1"])

    fair = [replace(poor_t, unsure_words_fair=uf, mean_logprob_fair=lf, ink_short_fair=sf, ink_long_fair=lgf)
            for uf, lf, sf, lgf in itertools.product((0.02, 0.05, 0.08, 0.1, 0.15, 0.2, 0.3), (-0.03, -0.05, -0.08,
                                                     -0.1, -0.15, -0.2, -0.3, -0.5), (0.6, 0.7, 0.8, 0.9),
                                                     (1.2, 1.4, 1.7, 2.0))
            if uf <= poor_t.unsure_words_poor and lf >= poor_t.mean_logprob_poor and sf >= poor_t.ink_short
            and lgf <= poor_t.ink_long]
    fscores = {id(t): fair_score(t) for t in fair}
    return middle(fair, lambda t: fscores.get(id(t)) or fair_score(t)) if fair else poor_t
