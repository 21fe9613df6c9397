"""The leaf layer: facts about this process and machine, and small helpers every other layer shares.
Nothing here imports another part of pyloader, MLX or mlx-lm at module level."""
