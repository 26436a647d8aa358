"""The fused-linear engine: the row planner, the tiler and the chunk loop that every op from hidden
states shares (the logits h W^T + b are computed tile by tile and reduced at once, never built
whole). It knows nothing of any loss."""
