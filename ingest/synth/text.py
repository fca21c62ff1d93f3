"""Text sources for synthetic documents: English-like word sequences and some Chinese.

`words.txt` (committed) holds ~3,000 words with counts, built once from Python standard-library
docstrings (`python -m ingest.synth.text --build-words`), so the generator does not depend on the
Python version of the machine it runs on. Chinese comes from a built-in list of common characters.
Word order is random (weighted by frequency): a decoder cannot guess the next word from a text prior,
it has to read it, while frequent words still become single BPE tokens.
"""

from __future__ import annotations

import random
from collections import defaultdict
from functools import lru_cache
from pathlib import Path

WORDS_FILE = Path(__file__).with_name("words.txt")

# ~400 common simplified Chinese characters (frequency order, roughly).
CHINESE_CHARS = (
    "的一是不了人我在有他这中大来上国个到说们为子和你地出道也时年得就那要下以生会自着去之过家学对可她里后小么"
    "心多天而能好都然没日于起还发成事只作当想看文无开手十用主行方又如前所本见经头面公同三已老从动两长知民样现分"
    "将外但身些与高意进把法此实回二理美点月明其种声全工己话儿者向情部正名定女问力机给等几很业最间新什打便位因重"
    "被走电四第门相次东政海口使教西再平真听世气信北少关并内加化由却代军产入先山五太水万市眼体别处总才场师书比住"
    "员九笑性通目华报立马命张活难神数件安表原车白应路期叫死常提感金何更反合放做系计或司利受光王果亲界及今京务制"
    "解各任至清物台象记边共风战干接它许八特觉望直服毛林题建南度统色字请交爱让认算论百吃义科怎元社术结六功指思非"
    "流每青管夫连远资队跟带花快条院变联言权往展该领传近留红治决周保达办运武半候七必城父强步完革深区即求品士转量"
    "空甚众技轻程告江语英基派满式李息写呢识极令黄德收脸钱党倒未持取设始版双历越史商千片容研像找友孩站广改议形委"
    "早房音火际则首单据导影失拿网香似斯专石若兵弟谁校读志飞观争究包组造落视济喜离虽坐集编宝谈府拉黑且随格尽剑讲"
)
CONTRACTIONS = ["don't", "isn't", "it's", "you're", "let's", "aren't", "can't", "won't", "doesn't", "there's",
                "that's", "we'll", "I'm", "they're", "wasn't", "o'clock"]
CHINESE_WORDS = ["文件", "数据", "系统", "处理", "页面", "模型", "识别", "结果", "时间", "记录", "档案", "目录",
                 "报告", "年度", "图书馆", "研究", "工作", "问题", "方法", "质量", "版本", "表格", "第一章", "说明"]

# Character classes of the auxiliary "which character is where" target used in training (0 = nothing there).
CHARSET = "".join(chr(c) for c in range(33, 127)) + "•，。；" + "".join(
    dict.fromkeys(CHINESE_CHARS + "".join(CHINESE_WORDS)))
CHAR_INDEX = {ch: i + 1 for i, ch in enumerate(CHARSET)}
N_CHAR_CLASSES = len(CHARSET) + 2  # + nothing (0) + any other character (last)


@lru_cache(maxsize=1)
def word_weights() -> tuple[tuple[str, float], ...]:
    """(word, sampling weight) of the word list: count ** 0.6, so common words are common but not dominant."""
    pairs = []
    for line in WORDS_FILE.read_text(encoding="utf-8").splitlines():
        word, count = line.split()
        pairs.append((word, int(count) ** 0.6))
    return tuple(pairs)


@lru_cache(maxsize=1)
def word_table() -> tuple[list[str], list[float]]:
    """Words and cumulative sampling weights (`word_weights`)."""
    words, cum, total = [], [], 0.0
    for word, weight in word_weights():
        total += weight
        words.append(word)
        cum.append(total)
    return words, cum


@lru_cache(maxsize=1)
def letter_chain() -> dict[str, tuple[list[str], list[float]]]:
    """Letter bigram statistics of the word list (weighted like `word_table`): for each letter (and "^", the
    start), the letters that follow it and "$" (the end), with cumulative weights."""
    counts: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for word, weight in word_weights():
        if word.isalpha() and word.isascii():
            for a, b in zip("^" + word.lower(), word.lower() + "$"):
                counts[a][b] += weight
    chain = {}
    for a, nxt in counts.items():
        letters, cum, total = [], [], 0.0
        for b, w in sorted(nxt.items()):
            total += w
            letters.append(b)
            cum.append(total)
        chain[a] = (letters, cum)
    return chain


def pseudo_word(rng: random.Random) -> str:
    """An English-looking word that is (almost always) not in the word list: 3-11 letters from the list's letter
    bigrams. A decoder cannot recall it; it has to read it letter by letter."""
    chain = letter_chain()
    while True:
        out, prev = [], "^"
        while len(out) < 11:
            letters, cum = chain[prev]
            prev = rng.choices(letters, cum_weights=cum)[0]
            if prev == "$":
                break
            out.append(prev)
        if len(out) >= 3:
            return "".join(out)


def words(rng: random.Random, n: int, open_words: float = 0.0) -> list[str]:
    """n words of the list; with ``open_words`` > 0 each is replaced by a `pseudo_word` with that probability
    (0 draws nothing extra, so documents of a seed stay what they were)."""
    table, cum = word_table()
    out = rng.choices(table, cum_weights=cum, k=n)
    if open_words > 0:
        out = [pseudo_word(rng) if rng.random() < open_words else w for w in out]
    return out


def _token(rng: random.Random) -> str:
    """An occasional non-word token: a number, a year, a percentage, an acronym, a code."""
    kind = rng.random()
    if kind < 0.3:
        return str(rng.randint(0, 999))
    if kind < 0.5:
        return str(rng.randint(1850, 2030))
    if kind < 0.65:
        return f"{rng.randint(0, 99)}.{rng.randint(0, 9)}%"
    if kind < 0.8:
        return "".join(rng.choice("ABCDEFGHIJKLMNOPRSTUVW") for _ in range(rng.randint(2, 4)))
    return f"{rng.choice('ABCDEFGHKMNPRSTX')}-{rng.randint(1, 99)}"


def sentence(rng: random.Random, n_words: int | None = None, open_words: float = 0.0) -> str:
    n = n_words or rng.randint(4, 14)
    out = []
    for i, w in enumerate(words(rng, n, open_words)):
        r = rng.random()
        if r < 0.06:
            w = _token(rng)
        elif r < 0.1:
            w = w.capitalize()
        elif r < 0.12:
            w = rng.choice(CONTRACTIONS)
        elif r < 0.13:
            w = rng.choice(['"', "*", "'"]) + w + rng.choice(['"', "*", "'"])
        if i == 0:
            w = w[:1].upper() + w[1:]
        if i < n - 1 and rng.random() < 0.08:
            w += rng.choice([",", ",", ";", ":", " --", " -", "/"])
        out.append(w)
    if n >= 4 and rng.random() < 0.08:
        a = rng.randint(1, n - 2)
        out[a] = "(" + out[a]
        out[a + 1] = out[a + 1].rstrip(",;:") + ")"
    return " ".join(out) + rng.choice([".", ".", ".", ".", "?", "!", ":"])


def paragraph(rng: random.Random, n_chars: int, open_words: float = 0.0) -> str:
    parts: list[str] = []
    length = 0
    while length < n_chars:
        s = sentence(rng, open_words=open_words)
        parts.append(s)
        length += len(s) + 1
    return " ".join(parts)


def phrase(rng: random.Random, lo: int = 1, hi: int = 5, open_words: float = 0.0) -> str:
    """A heading-like phrase (title case on the first word, no final period)."""
    ws = words(rng, rng.randint(lo, hi), open_words)
    if rng.random() < 0.3:
        ws = [w.capitalize() for w in ws]
    ws[0] = ws[0][:1].upper() + ws[0][1:]
    return " ".join(ws)


def chinese(rng: random.Random, n_chars: int) -> str:
    """Chinese text: runs of common characters and words with Chinese punctuation."""
    out: list[str] = []
    run = 0
    while len("".join(out)) < n_chars:
        if rng.random() < 0.25:
            piece = rng.choice(CHINESE_WORDS)
        elif rng.random() < 0.05:
            piece = str(rng.randint(1, 2030))
        else:
            piece = rng.choice(CHINESE_CHARS)
        out.append(piece)
        run += len(piece)
        if run > rng.randint(6, 16):
            out.append(rng.choice("，，，。；"))
            run = 0
    text = "".join(out).rstrip("，；")
    return text if text.endswith("。") else text + "。"


def cell(rng: random.Random) -> str:
    r = rng.random()
    if r < 0.45:
        return str(rng.randint(0, 9999)) if rng.random() < 0.5 else f"{rng.randint(0, 999)}.{rng.randint(0, 99):02d}"
    if r < 0.55:
        return _token(rng)
    return " ".join(words(rng, rng.randint(1, 2)))


def build_word_list(limit: int = 3000) -> list[tuple[str, int]]:
    """Words from standard-library docstrings, most frequent first (run once; the result is committed)."""
    import collections
    import importlib
    import inspect
    import re

    modules = ("argparse json logging textwrap collections functools itertools os pathlib re string subprocess "
               "threading typing unittest csv sqlite3 datetime decimal fractions statistics random heapq bisect "
               "shutil tempfile zipfile tarfile gzip hashlib secrets socket asyncio contextlib dataclasses enum "
               "inspect pickle copy pprint difflib calendar locale codecs io time queue multiprocessing "
               "configparser fnmatch glob zlib base64 struct array weakref types operator math doctest timeit "
               "warnings traceback ast platform ipaddress mimetypes smtplib uuid wave colorsys").split()
    counts: collections.Counter = collections.Counter()
    seen: set[int] = set()

    def docs(obj, depth=0):
        if id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(getattr(obj, "__doc__", None), str):
            yield obj.__doc__
        if depth < 2 and (inspect.ismodule(obj) or inspect.isclass(obj)):
            for name in dir(obj):
                if not name.startswith("_"):
                    value = getattr(obj, name, None)
                    if value is not None and not inspect.ismodule(value) and callable(value):
                        yield from docs(value, depth + 1)

    for name in modules:
        try:
            module = importlib.import_module(name)
        except Exception:  # noqa: BLE001 - a module missing on this platform is skipped
            continue
        for doc in docs(module):
            counts.update(w.lower() for w in re.findall(r"\b[A-Za-z][a-z]{1,13}\b", doc))
    return counts.most_common(limit)


if __name__ == "__main__":
    import sys

    if "--build-words" in sys.argv:
        pairs = build_word_list()
        WORDS_FILE.write_text("".join(f"{w} {c}\n" for w, c in pairs), encoding="utf-8")
        print(f"wrote {len(pairs)} words to {WORDS_FILE}")
    else:
        rng = random.Random(0)
        print(paragraph(rng, 300))
        print(chinese(rng, 60))
