"""fv-ltx2 plugin entry point.

Registers nothing yet: the LTX-2 cards are not built. It installs and is discovered so deploy files can name it.
"""
