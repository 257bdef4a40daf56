"""Model files: the artifact container (format, reader, writer), conversion from Hugging Face and FP8 checkpoints and
z-lab drafters, synthetic weights for presets, the tokenizer, and loading what ``--model`` names."""
