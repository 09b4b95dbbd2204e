"""fv-qwen-image: Qwen-Image text-to-image cards for fv (the published 20B layout, a tiny random-weight
card, and any QwenImagePipeline folder by path). Loading the plugin imports no torch."""
