"""fv-train-flow: flow-matching training on the serve loops, plus the synthetic shapes benchmark."""
