"""What a finished document becomes on disk: Markdown and JSON (write), ALTO, hOCR, the searchable PDF and PDF/A
(pdfa, with pdfa_fonts embedding the standard fonts born-digital pages name; archival ties them together).

May import reading/, pages/, the top modules and db/; never the worker or the commands."""
