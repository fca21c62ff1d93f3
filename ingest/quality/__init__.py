"""How good a page is: measures (CER, Distinct-n, ...), grades (good/fair/poor with reasons) and repair (re-reading
a doubtful page).

May import reading/, pages/, the top modules, engine/ and db/."""
