"""The standard 14 fonts a born-digital page uses without embedding them, embedded, so that its page can be PDF/A
without Ghostscript (ingest.outputs.pdfa).

A PDF may name Helvetica, Times, Courier (each in four styles), Symbol or ZapfDingbats without carrying the font:
every viewer has them. PDF/A wants every font embedded. MuPDF draws these fonts with its built-in URW equivalents
(Nimbus Sans, Nimbus Roman, Nimbus Mono PS, Standard Symbols PS, Dingbats: metric-compatible, the fonts Ghostscript
substitutes as well); each such font gets that program embedded (CFF, ``/FontFile3 /Type1C``), a font descriptor
read from the program, and ``/Widths`` as MuPDF measures each code with it, so the page looks and extracts as
before. Other fonts without a program (a TrueType Arial not embedded, say) are left as they are: OCRmyPDF's PDF/A
check then refuses the file and ingest.outputs.pdfa says so.

A CID font (``/CIDFontType0``) whose embedded CFF program is not CID-keyed (as MuPDF, and so PyMuPDF, writes the
text it adds to a page) is one pikepdf's PDF/A validator does not check; its program is rewritten CID-keyed
(``Adobe-Identity-0``, CID n = glyph n, which is how readers map such a font's CIDs already): the same glyphs for
the same codes.
"""

from __future__ import annotations

import io
import zlib
from types import SimpleNamespace

import pymupdf

STANDARD_14 = frozenset(pymupdf.Base14_fontdict.values())
SYMBOLIC = frozenset({"Symbol", "ZapfDingbats"})
# /Flags bits (PDF 32000-1 table 123)
FIXED_PITCH, SERIF, FLAG_SYMBOLIC, NONSYMBOLIC, ITALIC = 1, 2, 4, 32, 64


def _cff_metrics(program: bytes) -> tuple[list[float], float]:
    """The program's font bounding box and italic angle."""
    from fontTools.cffLib import CFFFontSet

    cff = CFFFontSet()
    cff.decompile(io.BytesIO(program), None)
    top = cff[cff.fontNames[0]]
    return [float(v) for v in top.FontBBox], float(getattr(top, "ItalicAngle", 0) or 0)


def _flags(name: str, italic_angle: float) -> int:
    flags = FLAG_SYMBOLIC if name in SYMBOLIC else NONSYMBOLIC
    if name.startswith("Courier"):
        flags |= FIXED_PITCH
    if name.startswith("Times"):
        flags |= SERIF
    if italic_angle:
        flags |= ITALIC
    return flags


def _unembedded_standard_fonts(doc: pymupdf.Document) -> dict[int, str]:
    """xref -> standard 14 name of each simple Type 1 font the pages use without a font program."""
    found: dict[int, str] = {}
    for pno in range(doc.page_count):
        for xref, ext, ftype, basefont, *_ in doc.get_page_fonts(pno, full=True):
            if xref and ext == "n/a" and ftype == "Type1" and basefont in STANDARD_14:
                found[xref] = basefont
    return found


def embed_standard_fonts(doc: pymupdf.Document) -> list[str]:
    """Embed the standard 14 fonts ``doc``'s pages use without a program (in place); returns their names."""
    embedded = []
    programs: dict[str, tuple[int, list[float], float]] = {}  # one program stream per font name
    for xref, name in _unembedded_standard_fonts(doc).items():
        if doc.xref_get_key(xref, "FontDescriptor")[0] != "null":
            continue  # a descriptor without a program: not the plain standard font this handles
        widths = [round(w * 1000) for _, w in doc.get_char_widths(xref, 256)]
        if name not in programs:
            program = pymupdf.Font(fontname=name).buffer
            stream = doc.get_new_xref()
            doc.update_object(stream, "<< /Subtype /Type1C >>")
            doc.update_stream(stream, program, compress=True)
            programs[name] = (stream, *_cff_metrics(program))
        stream, bbox, italic = programs[name]
        descriptor = doc.get_new_xref()
        doc.update_object(descriptor, (
            f"<< /Type /FontDescriptor /FontName /{name} /Flags {_flags(name, italic)} "
            f"/FontBBox [{' '.join(f'{v:g}' for v in bbox)}] /ItalicAngle {italic:g} /Ascent {bbox[3]:g} "
            f"/Descent {bbox[1]:g} /CapHeight {bbox[3]:g} /StemV 80 /FontFile3 {stream} 0 R >>"))
        doc.xref_set_key(xref, "FontDescriptor", f"{descriptor} 0 R")
        doc.xref_set_key(xref, "FirstChar", "0")
        doc.xref_set_key(xref, "LastChar", str(len(widths) - 1))
        doc.xref_set_key(xref, "Widths", f"[{' '.join(map(str, widths))}]")
        embedded.append(name)
    return embedded


def cid_keyed_cff(program: bytes) -> bytes | None:
    """``program`` (a CFF font) rewritten CID-keyed, CID n for glyph n; None when it is CID-keyed already."""
    from fontTools.cffLib import CFFFontSet, FDArrayIndex, FDSelect, FontDict

    cff = CFFFontSet()
    cff.decompile(io.BytesIO(program), None)
    name = cff.fontNames[0]
    top = cff[name]
    if hasattr(top, "ROS"):
        return None
    order = list(top.charset)
    cids = [".notdef"] + [f"cid{i:05d}" for i in range(1, len(order))]
    strings = top.CharStrings
    strings.charStrings = {cid: strings.charStrings[glyph] for glyph, cid in zip(order, cids)}
    fd = FontDict()
    fd.Private, fd.FontName = top.Private, name
    fd_array = FDArrayIndex()
    fd_array.append(fd)
    select = FDSelect()
    select.format, select.gidArray = 3, [0] * len(order)
    top.ROS, top.CIDCount, top.FDArray, top.FDSelect = ("Adobe", "Identity", 0), len(order), fd_array, select
    strings.fdArray, strings.fdSelect = fd_array, select
    top.charset = cids
    for key in ("Private", "Encoding"):  # a CID-keyed font has neither: its FDArray holds the private dict
        top.rawDict.pop(key, None)
        if key in vars(top):
            delattr(top, key)
    out = io.BytesIO()
    cff.compile(out, SimpleNamespace(recalcBBoxes=False))
    return out.getvalue()


def cid_key_cff_fonts(pdf) -> int:  # noqa: ANN001 - a pikepdf.Pdf
    """Rewrite CID-keyed each ``/CIDFontType0C`` program of ``pdf`` (a pikepdf.Pdf) that is not; returns how many."""
    import pikepdf

    done = 0
    for obj in pdf.objects:
        if not isinstance(obj, pikepdf.Stream) or obj.get("/Subtype") != "/CIDFontType0C":
            continue
        rewritten = cid_keyed_cff(obj.read_bytes())
        if rewritten is not None:
            obj.write(zlib.compress(rewritten), filter=pikepdf.Name.FlateDecode)
            if "/Length1" in obj:
                del obj["/Length1"]  # the old program's length
            done += 1
    return done
