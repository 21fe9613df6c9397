"""``pyloader compare``: loaders measured in fresh processes. See docs/compare.md."""
