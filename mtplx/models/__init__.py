"""Model acquisition: loading checkpoints (mlx-lm directories, GGUF files, known assets) and MTP heads."""
