"""specjax: exact speculative decoding in JAX."""
