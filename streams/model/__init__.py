"""The domain's vocabulary: operation states and their legal moves, the reason and outcome codes, and the
classified answers of the remote API. Pure data and rules; imports nothing of the product.
"""
