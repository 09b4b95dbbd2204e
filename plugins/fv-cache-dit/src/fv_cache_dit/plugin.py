"""fv-cache-dit plugin entry point.

Registers nothing yet: the interceptors are not built. It installs and is discovered so deploy files can name it.
"""
