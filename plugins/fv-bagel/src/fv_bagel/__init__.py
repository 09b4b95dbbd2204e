"""fv plugin for BAGEL (MoT: AR text + image diffusion on one instance)."""
