"""fv-train-self-forcing: a causal (chunk-by-chunk) student trained on its own rollouts by distribution
matching against a bidirectional teacher (Huang et al. 2025, "Self Forcing")."""
