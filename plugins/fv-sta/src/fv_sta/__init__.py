"""fv plugin: sliding tile attention kernels."""
