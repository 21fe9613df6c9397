"""``pyloader compare``: loaders measured like for like, each run in a fresh process with
the page cache controlled. See docs/compare.md."""
