"""Process groups, device mesh, data-parallel wrapping and sharding-invariant init."""
