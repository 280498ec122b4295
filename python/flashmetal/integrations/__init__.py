"""Framework integrations. Each imports its framework only when used:

- ``flashmetal.integrations.torch_op``: ``torch.ops.flashmetal.sdpa``, a
  torch.library custom op, so torch code (and ``torch.compile``) sees the
  kernel as one op.
- ``flashmetal.integrations.hf``: a Hugging Face transformers attention
  backend; ``flashmetal.integrations.hf.register()`` then
  ``from_pretrained(..., attn_implementation="fm_attention")``.
- ``flashmetal.integrations.mlx``: ``mx.fast.scaled_dot_product_attention``
  for MLX arrays, and ``patch()``, which makes mlx-lm's models use it.
"""
