"""fv-bagel plugin entry point.

Registers nothing yet: the BAGEL cards are not built. It installs and is discovered so deploy files can name it.
"""
