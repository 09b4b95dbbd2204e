"""fv-clip-score: CLIP score (text-image agreement) as a scorer and a reward."""
