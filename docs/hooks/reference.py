"""MkDocs hook: fills `<!-- reference: NAME -->` markers with tables generated from the code (stub)."""


def on_page_markdown(markdown, page, config, files):
    return markdown
