"""fv-train-dmd2: DMD2 distillation of a many-step teacher into a few fixed-step student."""
