"""fv-sta plugin entry point.

Registers nothing yet: the STA kernels are not built. It installs and is discovered so deploy files can name it.
"""
