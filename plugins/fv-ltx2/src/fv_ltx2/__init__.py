"""fv plugin for LTX-2 (joint audio+video, two-stage refine)."""
