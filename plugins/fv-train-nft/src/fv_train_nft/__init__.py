"""fv-train-nft: DiffusionNFT (Zheng et al. 2025) as an ``fv train`` method."""
